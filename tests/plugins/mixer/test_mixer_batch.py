"""The mixer at batch > 1: each row takes the input its own drafts choose, with that input's q."""

from __future__ import annotations

import pytest
import torch

from draftflow.core.plan import Env
from draftflow.plugin import Batch, NodeContext, Proposal, RequestState, SamplingParams
from draftflow.plugins.mixer.plugin import Mixer, choose, manifest

N, V = 5, 11


def mixer(policy: str, min_tokens: int = 2) -> Mixer:
    params = {"inputs": ["a", "b"], "policy": policy, "min_tokens": min_tokens}
    return Mixer(NodeContext("mix", params, manifest(params, Env("cpu", "float32", 4, None)), torch.device("cpu"),
                             torch.float32, 4, None, {}, {}, max_batch=N))


def rows():
    req = [RequestState(f"r{i}", 1, [1], SamplingParams(), torch.Generator(), 4, 0, i) for i in range(N)]
    req[2] = None  # a pad row
    return Batch(req, 4)


def row_of(p: Proposal, i: int) -> Proposal:
    """Row i as the batch-1 proposal it stands for (cut to its length)."""
    n = p.tokens.shape[1] if p.lengths is None else int(p.lengths[i])
    probs = None if p.probs is None else p.probs[i:i + 1, :n]
    ids = None if p.candidate_ids is None else p.candidate_ids[i:i + 1, :n]
    return Proposal(p.tokens[i:i + 1, :n], probs, ids)


def q_of(p: Proposal, j: int) -> torch.Tensor:
    """Row 0's q at draft j over the vocabulary (one-hot for deterministic drafts)."""
    if p.probs is None:
        return torch.nn.functional.one_hot(p.tokens[0, j], V).float()
    if p.candidate_ids is None:
        return p.probs[0, j]
    return torch.zeros(V).scatter_add_(0, p.candidate_ids[0, j], p.probs[0, j])


@pytest.mark.parametrize("policy", ["first-nonempty", "longest"])
@pytest.mark.parametrize("b_form", ["none", "full", "candidates"])
def test_rows_choose_like_batch_one(policy, b_form):
    """Per row: the chosen input, its drafts and its q equal what choose() picks from that row's own proposals."""
    gen = torch.Generator().manual_seed(0)
    a = Proposal(torch.randint(0, V, (N, 3), generator=gen), lengths=torch.tensor([3, 1, 0, 0, 2]))  # lookup-like
    b = Proposal(torch.randint(0, V, (N, 4), generator=gen))  # full width, MTP/DFlash-like
    if b_form == "full":
        b.probs = torch.softmax(torch.randn(N, 4, V, generator=gen), -1)
    elif b_form == "candidates":
        b.candidate_ids = torch.randint(0, V, (N, 4, 3), generator=gen)
        b.probs = torch.softmax(torch.randn(N, 4, 3, generator=gen), -1)
    node = mixer(policy)
    out = node.step(rows(), {"a": a, "b": b})["proposal"]
    assert out.tokens.shape == (N, 4) and out.lengths is not None
    for i in (0, 1, 3, 4):
        mine = [row_of(a, i), row_of(b, i)]
        want = mine[choose(mine, policy, 2)]
        got = row_of(out, i)
        assert got.tokens.tolist() == want.tokens.tolist(), (i, policy)
        if b_form != "none":
            for j in range(want.num_draft):
                torch.testing.assert_close(q_of(got, j), q_of(want, j))
    assert sum(node.chosen) == 4  # pad rows are not counted


def test_full_width_inputs_pass_unchanged():
    """Without lengths (the batch-1 case) one input is chosen for all rows and passed through as is."""
    a, b = Proposal(torch.zeros(N, 0, dtype=torch.long)), Proposal(torch.ones(N, 4, dtype=torch.long))
    node = mixer("first-nonempty", 1)
    assert node.step(rows(), {"a": a, "b": b})["proposal"] is b
    assert node.chosen == [0, 4]


def test_batched_mtp_and_lookup_graph_equals_each_request_alone(mtp_dirs):
    """The MTP + lookup + mixer graph at batch 3: every greedy request gives exactly its lone output."""
    from test_mixer import GRAPH, REPETITIVE, overrides

    from draftflow.core.executor import Executor
    from draftflow.core.plan import build_plan
    from draftflow.core.registry import load_registry
    from draftflow.core.spec import load_graph

    ex = Executor(build_plan(load_graph(GRAPH, overrides(mtp_dirs) + ["max_batch=3"]), load_registry()))
    requests = [(REPETITIVE, 30), ([40, 41, 42], 17), (REPETITIVE[2:] + [40, 41], 24)]
    alone = [ex.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True)).token_ids for p, n in requests]
    states = [ex.start(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in requests]
    while any(s.finish_reason is None for s in states):
        ex.step([s for s in states if s.finish_reason is None])
    together = [ex.finish(s) for s in states]
    assert [r.token_ids for r in together] == alone
    assert sum(r.stats["accepted"] for r in together) > 0
    assert all(ex.nodes["mix"].chosen)  # both drafters were chosen for some rows
