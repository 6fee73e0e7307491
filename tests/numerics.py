"""Float comparisons for parity tests: the error is judged against the compared values' scale.

Two float computations of the same math (chunked vs token by token, a batch vs one row, fused vs
split matmuls, another CPU's kernels) differ by rounding, and rounding error scales with the
magnitudes summed, not with each element. So an absolute `atol` is too loose for a tensor of scale
30 and too tight for one of scale 0.01, and an element's own relative error means nothing when the
element is near zero (the one that failed the hybrid parity test on a 2-core AMD CPU was 6e-3 in a
conv state of scale 3.8, 1.1e-5 off: 50 eps of the tensor's scale, 1800 eps of itself).

A float32 sum of n terms is off by at most about n * eps of the magnitudes it sums (Higham's
gamma_n), and errors add along a chain of such reductions, so `reduction_bound(n, depth)` is
depth * n * eps relative to the scale. Lives at the tests root (on sys.path via tests/conftest.py).
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2**-23


def reduction_bound(reduction: int, depth: int) -> float:
    """Relative bound for `depth` float32 reductions of at most `reduction` terms in series (gamma_n each)."""
    return depth * reduction * EPS32


def scaled_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (the plain max difference when `expected` is all zero)."""
    diff = (actual.detach().double() - expected.detach().double()).abs().max()
    scale = expected.detach().abs().max().double()
    return (diff / scale if scale > 0 else diff).item()


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, bound: float, what: str = "values") -> None:
    """Assert equal shapes and max |actual - expected| <= bound * max |expected|."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = scaled_error(actual, expected)
    scale = expected.abs().max().item()
    assert err <= bound, (f"{what}: max error {err:.2e} of the values' scale ({err / EPS32:.0f} float32 eps) exceeds "
                          f"{bound:.2e} ({bound / EPS32:.0f} eps); scale max|expected| = {scale:.3g}")


def tiny_model_bound(layers: int) -> float:
    """Two orders of the same forward through the tests' tiny models (hidden 64, MLP 96, drafters' fc over two
    64-wide taps: reductions of at most 128 terms; prompts and windows shorter than that): `layers` blocks + head."""
    return reduction_bound(128, layers + 1)
