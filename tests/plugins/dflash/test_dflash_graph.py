"""The dflash node in a graph: greedy gate, sampling proposals, static checks."""

from __future__ import annotations

import pytest
import torch
from dflash_testlib import BLOCK, VOCAB, agreeing_pair, write_graph

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import load_graph
from draftflow.testing import greedy_gate


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return agreeing_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def test_greedy_gate_matches_target_only_with_mixed_acceptance(pair, tmp_path, registry):
    """target + dflash + verifier emits exactly the target-only tokens, with some drafts accepted and some rejected."""
    graph = write_graph(tmp_path / "g.yaml", *pair)
    report = greedy_gate(graph, prompts=[[3, 4, 5, 6], [10, 11]], max_new_tokens=24, registry=registry)
    assert 0 < report.accepted < report.drafted


def test_short_num_draft_runs_shorter_blocks(pair, tmp_path, registry):
    """num_draft below block_size-1 drafts that many tokens per cycle and stays lossless."""
    graph = write_graph(tmp_path / "g.yaml", *pair, num_draft=2)
    report = greedy_gate(graph, prompts=[[10, 11]], max_new_tokens=12, registry=registry)
    assert report.drafted <= 2 * 12


def test_sampling_proposal_carries_full_q_and_samples_from_it(pair, tmp_path, registry):
    """At temperature > 0 the proposal holds q [1, K, V] (rows sum to 1) and tokens inside q's support."""
    plan = build_plan(load_graph(write_graph(tmp_path / "g.yaml", *pair)), registry)
    ex = Executor(plan)
    seen = []
    node = ex.nodes["drafter"]
    original = node.step

    def spy(req, inputs):
        out = original(req, inputs)
        seen.append(out["proposal"])
        return out

    node.step = spy
    result = ex.generate([3, 4, 5, 6], SamplingParams(temperature=0.8, top_k=50, max_new_tokens=10, seed=1))
    assert len(result.token_ids) == 10
    first = seen[0]
    assert first.probs.shape == (1, BLOCK - 1, VOCAB)
    torch.testing.assert_close(first.probs.sum(-1), torch.ones(1, BLOCK - 1))
    assert bool((first.probs.gather(-1, first.tokens[..., None]) > 0).all())
    assert int((first.probs[0] > 0).sum(-1).max()) <= 50


def test_check_reports_kv_grow_incompatibility(pair, tmp_path, registry):
    """A target with kv_mode grow is rejected before allocation, with the fix in the reason."""
    plan = build_plan(load_graph(write_graph(tmp_path / "g.yaml", *pair, kv_mode="grow")), registry)
    found = [p.render() for p in plan.problems]
    assert any("[incompatible]" in p and "provides 'kv.grow'" in p and "set the target's kv_mode: static" in p
               for p in found), found


def test_check_reports_mismatched_tap_layers(pair, tmp_path, registry):
    """Target tap_layers that differ from the drafter's target_layer_ids are a [dflash-taps] problem with the fix."""
    plan = build_plan(load_graph(write_graph(tmp_path / "g.yaml", *pair, tap_layers=[0, 2])), registry)
    found = [p.render() for p in plan.problems]
    assert any("[dflash-taps]" in p and "reads target layers [1, 2] but target 'target' taps [0, 2]" in p
               and "fix: set nodes.target.tap_layers=[1, 2]" in p for p in found), found


def test_cli_check_reports_both_problems(pair, tmp_path):
    """`draftflow check` exits non-zero and prints the kv.grow and tap-layer problems."""
    from helpers import run_cli

    graph = write_graph(tmp_path / "g.yaml", *pair, kv_mode="grow", tap_layers=[0, 2])
    out = run_cli(["check", graph])
    assert out.returncode != 0
    assert "[incompatible]" in out.stdout + out.stderr and "[dflash-taps]" in out.stdout + out.stderr


def test_target_params_hook_answers_the_trained_tap_layers(pair, registry):
    """draftflow_target_params: a dflash node asks for its artifact's target_layer_ids; other node types get no answer."""
    hook = registry.pm.hook.draftflow_target_params
    assert hook(plugin="dflash", params={"path": str(pair[1])}, target=None) == [{"tap_layers": [1, 2]}]
    assert hook(plugin="lookup", params={}, target=None) == []
