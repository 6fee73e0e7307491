"""The prompt-lookup node in graphs: greedy gate, CLI trace, incremental history."""

from __future__ import annotations

import json

from helpers import ROOT, run_cli

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import load_graph
from draftflow.testing import greedy_gate

GRAPH = ROOT / "graphs" / "lookup.yaml"
REPETITIVE = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]


def test_greedy_gate_with_lookup_drafts(cyclic_target):
    """The shipped lookup graph on a tiny target: output equals target-only, and drafts are accepted."""
    report = greedy_gate(GRAPH, [REPETITIVE, [40, 41, 42]], max_new_tokens=32,
                         overrides=[f"nodes.target.path={cyclic_target}"])
    assert 0 < report.accepted < report.drafted


def test_history_is_appended_not_rebuilt(cyclic_target):
    """After a request its slot's history equals prompt + output, grown by commits only."""
    plan = build_plan(load_graph(GRAPH, [f"nodes.target.path={cyclic_target}"]), load_registry())
    ex = Executor(plan)
    node = ex.nodes["lookup"]
    history = node.history
    result = ex.generate(REPETITIVE, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert node.history is history  # preallocated once at the planned KV capacity
    assert node.history.shape == (plan.vram.batch, plan.vram.kv_tokens)
    assert node.lengths == [0] * plan.vram.batch  # released when the request finished
    assert list(node.history[0, :len(REPETITIVE) + len(result.token_ids)]) == REPETITIVE + list(result.token_ids)


def test_cli_lookup_trace_reports_accepted_drafts(cyclic_target, tmp_path):
    """`draftflow generate --target DIR --lookup --trace` on a repetitive prompt records accepted drafts."""
    trace = tmp_path / "t.jsonl"
    proc = run_cli(["generate", "--target", cyclic_target, "--lookup", "--trace", trace, "--ignore-eos",
                    "--prompt-ids", ",".join(map(str, REPETITIVE)), "--max-new-tokens", 32])
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    cycles = [e for e in events if "draft" in e]
    assert sum(e["accepted"] for e in cycles) > 0
