"""Tests for greedy_accept: the temperature-0 acceptance rule."""

import pytest
import torch

from draftflow.verify import greedy_accept


def _logits_for(target_ids: list[list[int]], vocab_size: int = 8) -> torch.Tensor:
    """Logits [B, K+1, V] whose argmax is `target_ids`."""
    ids = torch.tensor(target_ids)  # [B, K+1]
    return torch.nn.functional.one_hot(ids, vocab_size).float() * 5 + 0.1 * torch.rand(*ids.shape, vocab_size)


def test_full_match_emits_all_drafts_and_bonus():
    """All K drafts equal the argmax: accepted = K and the bonus argmax is appended."""
    accepted, emitted = greedy_accept(torch.tensor([[1, 2, 3]]), _logits_for([[1, 2, 3, 7]]))
    assert accepted.tolist() == [3]
    assert emitted.tolist() == [[1, 2, 3, 7]]


def test_first_mismatch_emits_only_target_token():
    """A mismatch at position 0 accepts nothing and emits the target's token there."""
    accepted, emitted = greedy_accept(torch.tensor([[4, 2, 3]]), _logits_for([[1, 2, 3, 7]]))
    assert accepted.tolist() == [0]
    assert emitted.tolist() == [[1, -1, -1, -1]]


def test_mismatch_in_middle_stops_even_if_later_drafts_match():
    """Drafts after the first mismatch are discarded even when they match the argmax."""
    accepted, emitted = greedy_accept(torch.tensor([[1, 5, 3]]), _logits_for([[1, 2, 3, 7]]))
    assert accepted.tolist() == [1]
    assert emitted.tolist() == [[1, 2, -1, -1]]


def test_no_drafts_emits_the_target_token():
    """K = 0 accepts nothing and emits the argmax of the single target row."""
    accepted, emitted = greedy_accept(torch.zeros(2, 0, dtype=torch.long), _logits_for([[6], [2]]))
    assert accepted.tolist() == [0, 0]
    assert emitted.tolist() == [[6], [2]]


def test_batch_rows_accept_independently_and_pad_with_minus_one():
    """Each row has its own accept count; slots after the emitted tokens hold -1."""
    drafts = torch.tensor([[1, 2, 3], [1, 0, 0], [0, 2, 3], [1, 2, 0]])  # [4, 3]
    logits = _logits_for([[1, 2, 3, 4]] * 4)  # [4, 4, 8]
    accepted, emitted = greedy_accept(drafts, logits)
    assert accepted.tolist() == [3, 1, 0, 2]
    assert emitted.tolist() == [[1, 2, 3, 4], [1, 2, -1, -1], [1, -1, -1, -1], [1, 2, 3, -1]]
    assert accepted.dtype == emitted.dtype == torch.int64


def test_shape_mismatch_names_expected_shape():
    """target_logits without the extra bonus row is rejected with the expected shape."""
    with pytest.raises(ValueError, match=r"needs \[1, 4, V\]: one row per draft plus one for the bonus"):
        greedy_accept(torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 8))
