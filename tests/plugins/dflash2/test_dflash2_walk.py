"""The greedy selector walk composed on the device equals the row-by-row walk it replaces."""

from __future__ import annotations

import pytest
import torch

from draftflow.plugins.dflash.dflash2_model import _greedy_walk


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
    assert torch.equal(_greedy_walk(scores, ids), _row_by_row(scores, ids))


def test_composed_walk_follows_the_predecessor():
    """A chain where each row's best candidate depends on the previous pick (a walk that ignored it would differ)."""
    k, m = 5, 4
    scores = torch.zeros(1, k, m, m)
    for n in range(k):
        for p in range(m):
            scores[0, n, p, (p + n + 1) % m] = 1.0  # after pick p, row n prefers candidate p + n + 1
    ids = torch.arange(k * m).view(1, k, m)
    want = _row_by_row(scores, ids)
    assert torch.equal(_greedy_walk(scores, ids), want)
    assert want.tolist() == [[1, 7, 10, 14, 19]]  # picks 1, 3, 2, 2, 3
