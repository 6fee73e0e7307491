"""MoE targets in graphs: the expert-cache plan line, the greedy gate with DFlash, per-cycle trace fields."""

from __future__ import annotations

import re

import pytest
import structlog
import torch
from helpers import run_cli
from moe_testlib import moe_dflash_pair, write_moe_graph

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import load_graph
from draftflow.testing import greedy_gate, target_only

TOTAL = 3 * 16  # three MoE layers of 16 experts (layer 0 is dense)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return moe_dflash_pair(tmp_path_factory.mktemp("moe-pair"))


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def _plan(path, registry):
    return build_plan(load_graph(path), registry)


def test_greedy_gate_dflash_on_moe_target_with_pinned_cache(pair, tmp_path, registry):
    """DFlash on an MoE target with expert_cache pinned to half: speculative output equals target-only, some drafts accepted."""
    graph = write_moe_graph(tmp_path / "g.yaml", *pair, expert_cache=TOTAL // 2)
    report = greedy_gate(graph, prompts=[[3, 4, 5, 6], [10, 11]], max_new_tokens=24, registry=registry)
    assert 0 < report.accepted < report.drafted


def test_check_shows_expert_cache_and_drafter_cost(pair, tmp_path, registry):
    """`draftflow check` prints how many experts are resident and how many the DFlash drafter costs."""
    free = _plan(write_moe_graph(tmp_path / "free.yaml", *pair), registry)
    per = free.vram.experts.bytes_per_expert
    used = sum(r.total - r.experts for r in free.vram.rows)
    drafter = next(r.total for r in free.vram.rows if r.node == "drafter")
    budget = used + 30 * per + per // 2
    graph = write_moe_graph(tmp_path / "g.yaml", *pair, vram_budget=budget)
    out = run_cli(["check", graph])
    assert out.returncode == 0, out.stderr
    m = re.search(r"expert cache: (\d+) of (\d+) experts resident .*vram_budget\); the dflash drafter \('drafter'\) "
                  r"costs (\d+) of them", out.stdout)
    assert m, out.stdout
    assert (int(m[1]), int(m[2]), int(m[3])) == (30, TOTAL, min(TOTAL - 30, (per // 2 + drafter) // per))
    # The target-only twin has the drafter's bytes back, so autosizing would give it more experts: hence pinning.
    twin = build_plan(target_only(load_graph(graph), registry), registry)
    assert twin.vram.experts.resident > 30
    pinned = run_cli(["check", graph, "--expert-cache", "12"])
    assert "expert cache: 12 of 48 experts resident" in pinned.stdout and "pinned by expert_cache" in pinned.stdout


def test_budget_below_the_minimum_expert_cache_is_one_clear_error(pair, tmp_path, registry):
    """A budget that cannot hold top-k experts per MoE layer after weights and KV is a plan error naming the fix."""
    free = _plan(write_moe_graph(tmp_path / "free.yaml", *pair), registry)
    used = sum(r.total - r.experts for r in free.vram.rows)
    plan = _plan(write_moe_graph(tmp_path / "g.yaml", *pair, vram_budget=used + free.vram.experts.bytes_per_expert), registry)
    [problem] = [p for p in plan.problems if p.rule == "vram"]
    assert "the expert cache fits only 1 experts" in problem.message and "12 needed" in problem.message
    assert "raise vram_budget by" in problem.fix
    low = _plan(write_moe_graph(tmp_path / "low.yaml", *pair, expert_cache=5), registry)
    [below] = [p for p in low.problems if "expert_cache=5 is below the minimum of 12" in p.message]
    line = next(i for i, text in enumerate((tmp_path / "low.yaml").read_text().splitlines(), 1) if "expert_cache" in text)
    col = (tmp_path / "low.yaml").read_text().splitlines()[line - 1].index("expert_cache") + 1
    assert below.where.endswith(f":{line}:{col}"), below.where  # points at the param, not at vram_budget


def test_cycle_events_carry_expert_cache_fields(pair, tmp_path, registry):
    """Every draft_cycle event has expert_hits, expert_misses and expert_upload_bytes for its own window."""
    plan = _plan(write_moe_graph(tmp_path / "g.yaml", *pair, expert_cache=12), registry)
    ex = Executor(plan, hook=registry.pm.hook)
    with structlog.testing.capture_logs() as logs:
        ex.generate([3, 4, 5, 6], SamplingParams(max_new_tokens=10))
    cycles = [e for e in logs if e["event"] == "draft_cycle"]
    per = plan.vram.experts.bytes_per_expert
    assert cycles and all({"expert_hits", "expert_misses", "expert_upload_bytes"} <= set(e) for e in cycles)
    for e in cycles:
        window = len(e["draft"]) + 1
        assert e["expert_upload_bytes"] == e["expert_misses"] * per
        assert 3 * 4 <= e["expert_hits"] + e["expert_misses"] <= 3 * min(16, 4 * window)  # distinct experts per layer
    assert sum(e["expert_misses"] for e in cycles) > 0
    target = ex.nodes["target"]
    assert target.runner is None and target.model.expert_cache.resident == 12
    assert isinstance(target.model.expert_cache.slot_gate_up, torch.Tensor)


def test_trace_summarize_totals_the_expert_fields(pair, tmp_path):
    """`draftflow trace summarize` on an MoE run's trace prints the expert-cache totals the cycle events carry."""
    import json

    graph = write_moe_graph(tmp_path / "g.yaml", *pair, expert_cache=24)
    trace = tmp_path / "t.jsonl"
    r = run_cli(["generate", "--graph", graph, "--prompt-ids", "3,4,5,6", "--max-new-tokens", "12", "--trace", trace])
    assert r.returncode == 0, r.stderr
    cycles = [e for e in map(json.loads, trace.read_text().splitlines()) if e["event"] == "draft_cycle"]
    hits, misses = sum(e["expert_hits"] for e in cycles), sum(e["expert_misses"] for e in cycles)
    assert misses > 0  # a cache of 24 of 144 experts misses: the totals are not trivially zero
    s = run_cli(["trace", "summarize", trace])
    assert s.returncode == 0, s.stderr
    assert f"expert cache: {hits} hits, {misses} misses" in s.stdout, s.stdout
