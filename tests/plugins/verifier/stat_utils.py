"""Goodness-of-fit helpers for the distribution-preservation tests (no scipy needed)."""

from __future__ import annotations

import torch

# Cells expected to hold fewer draws than this are pooled into one cell, the usual
# rule of thumb for the chi-square approximation to hold.
MIN_EXPECTED_COUNT = 5.0


def chi_square_pvalue(
    counts: torch.Tensor,  # [N] observed counts
    probs: torch.Tensor,  # [N] exact cell probabilities, sum 1
) -> float:
    """p-value of Pearson's chi-square test that `counts` were drawn from `probs`.

    A draw in a cell of probability 0 is impossible under `probs`, so it gives 0.
    """
    counts = counts.double().flatten()
    probs = probs.double().flatten()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = counts.sum() * probs
    is_small = expected < MIN_EXPECTED_COUNT
    observed_cells = torch.cat([counts[~is_small], counts[is_small].sum()[None]])
    expected_cells = torch.cat([expected[~is_small], expected[is_small].sum()[None]])
    if expected_cells[-1] == 0:  # nothing was pooled
        observed_cells, expected_cells = observed_cells[:-1], expected_cells[:-1]
    statistic = ((observed_cells - expected_cells) ** 2 / expected_cells).sum()
    degrees_of_freedom = observed_cells.numel() - 1
    # The chi-square survival function is the regularised upper incomplete gamma.
    half_dof = torch.tensor(degrees_of_freedom / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(half_dof, statistic / 2))


def total_variation(
    counts: torch.Tensor,  # [N] observed counts
    probs: torch.Tensor,  # [N] exact cell probabilities, sum 1
) -> float:
    """Total variation distance between the empirical distribution and `probs`."""
    counts = counts.double().flatten()
    return float(0.5 * (counts / counts.sum() - probs.double().flatten()).abs().sum())
