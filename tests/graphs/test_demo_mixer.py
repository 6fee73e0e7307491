"""MTP + DFlash on the shipped demo pair: rejected without a mixer (the message names it), lossless with one."""

from __future__ import annotations

from helpers import ROOT, SMALL_PAIR

from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import GraphSpec
from draftflow.testing import greedy_gate

DEMO = SMALL_PAIR


def graph(mixer: bool) -> GraphSpec:
    nodes = {"target": {"plugin": "target", "params": {"path": str(DEMO / "target"), "tap_layers": [1, 2, 3]}},
             "dflash": {"plugin": "dflash", "params": {"path": str(DEMO / "dflash")}},
             "mtp": {"plugin": "mtp", "params": {"path": str(DEMO / "mtp")}},
             "verify": {"plugin": "verifier"}}
    edges = []
    if mixer:
        nodes["mix"] = {"plugin": "mixer", "params": {"inputs": ["a", "b"], "policy": "longest"}}
        edges = ["dflash.proposal -> mix.a", "mtp.proposal -> mix.b", "mix.proposal -> target.proposal",
                 "mix.proposal -> verify.proposal"]
    return GraphSpec.from_dict({"name": "mtp-dflash", "num_draft": 3, "nodes": nodes, "edges": edges})


def test_check_rejects_two_drafters_without_mixer_and_names_the_fix():
    """Without a mixer both proposal inputs have two producers; each problem's fix names the mixer node."""
    found = [p.render() for p in build_plan(graph(mixer=False), load_registry()).problems]
    assert len(found) == 2 and all("[duplicate-producer]" in p and "mixer node (plugin: mixer)" in p for p in found), found


def test_mixer_graph_passes_check_and_the_greedy_gate():
    """With the mixer the same drafters pass every check and the output equals target-only decoding."""
    registry = load_registry()
    assert build_plan(graph(mixer=True), registry).problems == []
    report = greedy_gate(graph(mixer=True), prompts=[[5, 6, 7, 8]], max_new_tokens=24, registry=registry)
    assert report.accepted > 0
