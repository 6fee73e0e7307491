"""The mixer node: policies, greedy gate of MTP + lookup, and what `draftflow check` says."""

from __future__ import annotations

import torch
import yaml
from helpers import ROOT, run_cli

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.ports import Proposal
from draftflow.core.registry import load_registry
from draftflow.core.spec import GraphSpec, load_graph
from draftflow.plugins.mixer.plugin import choose
from draftflow.testing import greedy_gate

GRAPH = ROOT / "graphs" / "mtp-lookup-mixer.yaml"
REPETITIVE = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]


def overrides(dirs):
    target, mtp = dirs
    return [f"nodes.target.path={target}", f"nodes.mtp.path={mtp}", "nodes.target.tap_layers=[0]"]


def p(n):
    return Proposal(torch.arange(n).reshape(1, n))


def test_first_nonempty_prefers_earlier_inputs_with_enough_drafts():
    """first-nonempty takes the first input with >= min_tokens drafts, else the last input."""
    assert choose([p(3), p(4)], "first-nonempty", 1) == 0
    assert choose([p(1), p(4)], "first-nonempty", 2) == 1
    assert choose([p(0), p(0)], "first-nonempty", 1) == 1
    assert choose([p(0), p(2), p(4)], "first-nonempty", 2) == 1


def test_longest_takes_most_drafts_earliest_on_ties():
    """longest takes the proposal with the most drafts, the earlier input on ties."""
    assert choose([p(2), p(4), p(4)], "longest", 1) == 1
    assert choose([p(0), p(0)], "longest", 1) == 0


def test_bad_inputs_param_is_a_check_problem():
    """Fewer than two input names is reported at check time with an example."""
    spec = GraphSpec.from_dict({"nodes": {"mix": {"plugin": "mixer", "params": {"inputs": ["a"]}}}})
    found = [q.render() for q in build_plan(spec, load_registry()).problems]
    assert any("node 'mix' (mixer) [manifest]" in q and "need two or more distinct lowercase port names" in q for q in found), found


def test_min_tokens_above_num_draft_is_a_check_problem():
    """first-nonempty with min_tokens above the graph's K could never take any input but the last: reported."""
    def problems(num_draft, policy="first-nonempty"):
        spec = GraphSpec.from_dict({"num_draft": num_draft, "nodes": {"mix": {"plugin": "mixer", "params": {
            "inputs": ["a", "b"], "min_tokens": 3, "policy": policy}}}})
        return [q.render() for q in build_plan(spec, load_registry()).problems if "[manifest]" in q.render()]

    assert any("min_tokens 3 is more than the graph's num_draft 2" in q and "takes the last input 'b'" in q
               and "set min_tokens to 2 or less, or num_draft to 3 or more" in q for q in problems(2)), problems(2)
    assert problems(3) == [] and problems(2, "longest") == []


def test_greedy_gate_mtp_and_lookup_through_mixer(mtp_dirs):
    """The shipped MTP + lookup + mixer graph is lossless, accepts drafts, and uses both drafters."""
    ovr = overrides(mtp_dirs)
    report = greedy_gate(GRAPH, [REPETITIVE, [40, 41, 42]], max_new_tokens=32, overrides=ovr)
    assert report.accepted > 0
    ex = Executor(build_plan(load_graph(GRAPH, ovr), load_registry()))
    ex.generate(REPETITIVE, SamplingParams(max_new_tokens=32, ignore_eos=True))
    lookup_cycles, mtp_cycles = ex.nodes["mix"].chosen
    assert lookup_cycles > 0 and mtp_cycles > 0


def test_check_rejects_two_drafters_without_mixer_and_accepts_with_one(mtp_dirs, tmp_path):
    """`draftflow check`: MTP + lookup alone fails naming the mixer as the fix; the mixer graph passes."""
    target, mtp = mtp_dirs
    bare = {"nodes": {"target": {"plugin": "target", "params": {"path": str(target), "tap_layers": [0]}},
                      "lookup": {"plugin": "prompt-lookup"}, "mtp": {"plugin": "mtp", "params": {"path": str(mtp)}},
                      "verify": {"plugin": "verifier"}}}
    (tmp_path / "bare.yaml").write_text(yaml.safe_dump(bare))
    rejected = run_cli(["check", tmp_path / "bare.yaml"])
    assert rejected.returncode != 0
    for node in ("verify", "target"):
        assert (f"node '{node}' ({'verifier' if node == 'verify' else 'target'}) [duplicate-producer]: input {node}.proposal "
                "(proposal) could be fed by lookup.proposal and mtp.proposal; fix: keep one edge into "
                f"{node}.proposal, or combine the drafters with a mixer node") in rejected.stderr, rejected.stderr
    accepted = run_cli(["check", GRAPH, *[a for o in overrides(mtp_dirs) for a in ("--set", o)]])
    assert accepted.returncode == 0, accepted.stderr
    assert "mix.proposal -> verify.proposal" in accepted.stdout


def test_mtp_and_oracle_need_a_mixer_too(mtp_dirs):
    """Any two drafters (here MTP + oracle) are rejected without a mixer and accepted with one."""
    target, mtp = mtp_dirs
    nodes = {"target": {"plugin": "target", "params": {"path": str(target), "tap_layers": [0]}},
             "oracle": {"plugin": "oracle", "params": {"reference": [1, 2, 3]}},
             "mtp": {"plugin": "mtp", "params": {"path": str(mtp)}}, "verify": {"plugin": "verifier"}}
    registry = load_registry()
    bare = build_plan(GraphSpec.from_dict({"nodes": nodes}), registry)
    assert {(q.node, q.rule) for q in bare.problems} == {("target", "duplicate-producer"), ("verify", "duplicate-producer")}
    assert all("mixer" in q.fix for q in bare.problems)
    mixed = build_plan(GraphSpec.from_dict({"nodes": {**nodes, "mix": {"plugin": "mixer"}}, "edges": [
        "oracle.proposal -> mix.a", "mtp.proposal -> mix.b", "mix.proposal -> target.proposal",
        "mix.proposal -> verify.proposal"]}), registry)
    assert mixed.problems == []
