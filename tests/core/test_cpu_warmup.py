"""`Session.open` warms a CPU graph up: the target and the DFlash/DFlash2/MTP drafter pack their float32 weights for
oneDNN there and build its kernels for the row counts a request brings (layers/cpu_linear.py), so no request pays
for a pack or a kernel build."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL_PAIR

from draftflow.core.session import Session
from draftflow.core.node import SamplingParams
from draftflow.layers import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.HAS_PACKING, reason="this torch build cannot pack oneDNN weights")


@pytest.fixture
def counted_packs(monkeypatch):
    """A fresh pack cache and a count of the packs made."""
    monkeypatch.setattr(cpu_linear, "PACKS", cpu_linear._Packs())
    calls = []
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def counting(*args, **kw):
        calls.append(args[0].shape)
        return reorder(*args, **kw)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", counting)
    return calls


MTP_GRAPH = {"name": "mtp", "device": "cpu", "dtype": "float32", "num_draft": 3, "nodes": {
    "target": {"plugin": "target", "params": {"path": str(SMALL_PAIR / "target"), "tap_layers": [3]}},
    "drafter": {"plugin": "mtp", "params": {"path": str(SMALL_PAIR / "mtp")}}, "verify": {"plugin": "verifier"}}}


@pytest.mark.parametrize("graph,fc_inputs", [("demo.yaml", 3), ("demo-dflash2.yaml", 3), (MTP_GRAPH, 2)])
def test_open_packs_every_weight_and_a_request_packs_none(counted_packs, graph, fc_inputs):
    session = Session.open(SMALL_PAIR / graph) if isinstance(graph, str) else Session.open(graph_dict=graph)
    try:
        at_open = len(counted_packs)
        hidden = session.executor.handle.config.hidden_size
        assert any(s[1] == fc_inputs * hidden for s in counted_packs), "the drafter's input projection was not packed"
        first = session.generate(session.encode("def add(a, b):"), SamplingParams(max_new_tokens=24))
        assert len(counted_packs) == at_open, "a request packed a weight"
        assert first.stats["cycles"] < 24  # drafts were accepted: the drafter ran
    finally:
        session.close()


# demo.yaml's drafter at a fixed K: its adaptive_k policy may skip drafting in a cycle (a timing-dependent choice),
# and the next cycle's drafter then ingests more than K+1 context rows, a length no warm-up can know
DFLASH_GRAPH = {"name": "dflash", "device": "cpu", "dtype": "float32", "num_draft": 7, "nodes": {
    "target": {"plugin": "target", "params": {"path": str(SMALL_PAIR / "target"), "kv_mode": "static",
                                              "tap_layers": [1, 2, 3]}},
    "drafter": {"plugin": "dflash", "params": {"path": str(SMALL_PAIR / "dflash")}}, "verify": {"plugin": "verifier"}}}


@pytest.mark.parametrize("graph", [DFLASH_GRAPH, "demo-dflash2.yaml", MTP_GRAPH], ids=["dflash", "dflash2-cut", "mtp"])
def test_a_request_meets_no_product_shape_the_warm_up_did_not_build(monkeypatch, graph):
    """oneDNN builds a kernel per (row count, weight shape) at its first product (~0.5 ms on a 2-core EPYC): the first
    request (verify windows of many widths, context lengths, cut draft rows) runs none the warm-up did not. Its prompt
    has at most K+1 tokens: a longer prompt's prefill runs at its own length, which no warm-up can know."""
    seen = []
    real = cpu_linear._onednn
    monkeypatch.setattr(cpu_linear, "_onednn",
                        lambda rows, w, b: seen.append((w.size(0), w.size(1), rows.shape[0])) or real(rows, w, b))
    if isinstance(graph, str):
        session = Session.open(SMALL_PAIR / graph, overrides=["nodes.drafter.params.min_path_prob=0.05"]
                               if graph == "demo-dflash2.yaml" else ())
    else:
        session = Session.open(graph_dict=graph)
    try:
        built, k = set(seen), session.plan.spec.num_draft
        seen.clear()
        result = session.generate(session.encode("def add(a, b):")[:k + 1], SamplingParams(max_new_tokens=32))
    finally:
        session.close()
    assert result.stats["cycles"] < 32 and len(seen) > 50
    assert set(seen) <= built, sorted(set(seen) - built)
    head = max(built)[:2]  # the LM head, the largest weight here: at every verify width
    assert {(*head, w) for w in range(1, k + 2)} <= built
