"""Tests for draftflow.layers.sampling: filter_logits and sample."""

import pytest
import torch
from stat_utils import chi_square_pvalue, total_variation

from draftflow.verify import filter_logits, sample


def _nucleus_reference(probs_row: torch.Tensor, top_p: float) -> set[int]:
    """Smallest set of most likely ids whose mass reaches top_p, built one id at a time."""
    kept, mass = set(), 0.0
    for token_id in probs_row.argsort(descending=True).tolist():
        kept.add(token_id)
        mass += float(probs_row[token_id])
        if mass >= top_p:
            break
    return kept


def test_temperature_zero_is_one_hot_argmax():
    """Temperature 0 returns a one-hot row at the argmax, ignoring top-k/top-p."""
    logits = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(0))  # [3, 4, 10]
    probs = filter_logits(logits, temperature=0.0, top_k=3, top_p=0.5)
    expected = torch.nn.functional.one_hot(logits.argmax(-1), 10).float()
    assert torch.equal(probs, expected)


def test_temperature_scales_logits_before_softmax():
    """Without top-k/top-p the result is softmax(logits / temperature)."""
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))  # [5, 7]
    torch.testing.assert_close(filter_logits(logits, temperature=0.5), (logits / 0.5).softmax(-1))


def test_top_k_keeps_exactly_the_k_best_renormalised():
    """top_k keeps the k highest logits, in proportion to their softmax, and zeroes the rest."""
    logits = torch.randn(64, 20, generator=torch.Generator().manual_seed(2))  # [64, 20]
    probs = filter_logits(logits, temperature=1.0, top_k=4)
    best = logits.topk(4, dim=-1).indices  # [64, 4]
    expected = torch.zeros_like(probs).scatter_(-1, best, logits.gather(-1, best).softmax(-1))
    torch.testing.assert_close(probs, expected)


def test_top_k_at_least_vocab_size_is_a_no_op():
    """top_k >= V and top_k = 0 leave the distribution unchanged."""
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))  # [4, 6]
    for top_k in (0, 6, 100):
        torch.testing.assert_close(filter_logits(logits, top_k=top_k), logits.softmax(-1))


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_keeps_smallest_set_reaching_mass(top_p):
    """top_p keeps the smallest most-likely set with mass >= top_p (always the top token)."""
    logits = torch.randn(200, 16, generator=torch.Generator().manual_seed(4)) * 2  # [200, 16]
    full = logits.softmax(-1)
    probs = filter_logits(logits, temperature=1.0, top_p=top_p)
    for row in range(logits.shape[0]):
        kept = set(torch.nonzero(probs[row]).flatten().tolist())
        assert kept == _nucleus_reference(full[row], top_p)
    torch.testing.assert_close(probs.sum(-1), torch.ones(200))


def test_top_p_applies_after_top_k():
    """top_p measures mass on the top-k renormalised distribution, as ordinary samplers do."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])  # [1, 5]
    top2 = logits[:, :2].softmax(-1)[0]  # the first id holds ~73% of the top-2 mass
    probs = filter_logits(logits, top_k=2, top_p=float(top2[0]) - 0.01)
    assert torch.nonzero(probs[0]).flatten().tolist() == [0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature=-1.0 is negative"),
        ({"top_k": -2}, "top_k=-2 is negative"),
        ({"top_p": 0.0}, r"top_p=0.0 is outside \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5 is outside \(0, 1\]"),
    ],
)
def test_invalid_arguments_are_rejected_with_fix(kwargs, message):
    """Bad temperature/top_k/top_p raise ValueError naming the value and the valid range."""
    with pytest.raises(ValueError, match=message):
        filter_logits(torch.zeros(1, 4), **kwargs)


def test_sample_matches_unnormalised_weights():
    """sample draws index i with probability w_i / sum(w) and never a zero-weight id."""
    weights = torch.tensor([0.0, 1.0, 2.0, 0.0, 3.0, 6.0])  # [6], unnormalised
    ids = sample(weights.expand(200_000, 6), torch.Generator().manual_seed(5))  # [200000]
    counts = torch.bincount(ids, minlength=6)
    probs = weights / weights.sum()
    assert chi_square_pvalue(counts, probs) > 1e-3
    assert total_variation(counts, probs) < 0.01


def test_sample_repeats_with_seed():
    """The same seed gives the same ids; a different seed gives different ids."""
    probs = torch.rand(1000, 30, generator=torch.Generator().manual_seed(6))  # [1000, 30]
    first = sample(probs, torch.Generator().manual_seed(7))
    assert torch.equal(first, sample(probs, torch.Generator().manual_seed(7)))
    assert not torch.equal(first, sample(probs, torch.Generator().manual_seed(8)))
