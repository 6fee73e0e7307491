"""The greedy selector walk composed on the device equals the row-by-row walk it replaces."""

from __future__ import annotations

import pytest
import torch

from draftflow.plugins.dflash.dflash2_model import greedy_walk


def _row_by_row(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row n picks argmax over its candidates after row n-1's pick (row 1 after predecessor 0), one row at a time."""
    drafts = []
    for row_scores, row_ids in zip(scores, ids):
        pick, row = 0, []
        for n in range(row_scores.shape[0]):
            pick = int(row_scores[n, pick].argmax())
            row.append(int(row_ids[n, pick]))
        drafts.append(row)
    return torch.tensor(drafts, dtype=torch.long)


@pytest.mark.parametrize("k", [1, 2, 3, 7, 15, 16])
def test_composed_walk_equals_row_by_row(k):
    """Random scores (some rounded so ties occur, first index wins) over every K a block of 16 offers."""
    gen = torch.Generator().manual_seed(k)
    b, m = 3, 16
    scores = torch.randn(b, k, m, m, generator=gen)
    scores[1] = scores[1].round()  # many equal scores: both walks take the first maximal candidate
    ids = torch.randint(0, 1000, (b, k, m), generator=gen)
    assert torch.equal(greedy_walk(scores, ids), _row_by_row(scores, ids))


def test_composed_walk_follows_the_predecessor():
    """A chain where each row's best candidate depends on the previous pick (a walk that ignored it would differ)."""
    k, m = 5, 4
    scores = torch.zeros(1, k, m, m)
    for n in range(k):
        for p in range(m):
            scores[0, n, p, (p + n + 1) % m] = 1.0  # after pick p, row n prefers candidate p + n + 1
    ids = torch.arange(k * m).view(1, k, m)
    want = _row_by_row(scores, ids)
    assert torch.equal(greedy_walk(scores, ids), want)
    assert want.tolist() == [[1, 7, 10, 14, 19]]  # picks 1, 3, 2, 2, 3


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_walk_graphs_walk_what_the_eager_walk_walks(device):
    """`GreedyWalkGraphs` (CUDA: captured, one graph per row count; CPU: the same step uncaptured) on random
    candidates gives `walk`'s greedy drafts for every row count, also after a wider call left stale rows behind."""
    from types import SimpleNamespace

    from draftflow.plugins.dflash.dflash2_model import CandidateSelector, walk
    from draftflow.plugins.dflash.selector_graphs import GreedyWalkGraphs

    rows, m, h, vocab = 15, 8, 32, 100
    cfg = SimpleNamespace(vocab_size=vocab, selector_rank=16, base=SimpleNamespace(hidden_size=h))
    torch.manual_seed(0)
    selector = CandidateSelector(cfg, torch.float32, device)
    for p in selector.parameters():
        p.data.normal_()
    graphs = GreedyWalkGraphs(selector, rows, m, h, torch.float32, device, capture=device == "cuda")
    graphs.warmup()
    assert len(graphs.graphs) == (rows if device == "cuda" else 0)
    gen = torch.Generator().manual_seed(1)
    for k in (rows, 3, 1, rows - 1, 2):
        ids = torch.randint(0, vocab, (1, k, m), generator=gen).to(device)
        scores = torch.randn(1, k, m, generator=gen).to(device)
        hidden = torch.randn(1, k, h, generator=gen).to(device)
        anchor = int(torch.randint(0, vocab, (1,), generator=gen))
        want, _ = walk(selector, ids, scores, hidden, torch.tensor([anchor], device=device), 0.0)
        got = graphs(ids, scores, hidden, anchor)
        assert got.shape == (1, k) and torch.equal(got, want), k
    with pytest.raises(ValueError, match="1..15 rows"):
        graphs(torch.zeros(1, rows + 1, m, dtype=torch.long, device=device), scores, hidden, 0)
