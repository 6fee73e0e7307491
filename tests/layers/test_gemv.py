"""The one-row GEMV (layers/gemv.py) is F.linear: split-K by the last arriver, widths not multiples of the tiles.

Run on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before triton loads), float32;
with CUDA the same tests run compiled, bf16 too.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from draftflow.layers import gemv  # noqa: E402
from draftflow.layers.triton_kernels import arrival_counters  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,k", [(20, 3000), (9, 700), (64, 2048)])
def test_gemv_is_f_linear(n, k):
    """float32 to rounding against F.linear, one K chunk or several (summed by the last program of each tile), and
    every arrival counter back at zero."""
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).to(DEVICE)
    x = torch.randn(1, 1, k, generator=gen).to(DEVICE)
    assert gemv.fits(x, weight)
    got = gemv.linear(x, weight)
    assert got.shape == (1, 1, n)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), atol=1e-4, rtol=1e-5)
    assert not arrival_counters(x.device).any()
    if k >= 2 * gemv.MIN_CHUNK:
        assert gemv.split_of(n, k, x.device)[1] > 1  # this shape took the split-K path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemv_bf16_within_rounding_of_cublas():
    """bf16 at the 30B-A3B o_proj shape: within bf16 rounding of cuBLAS (a different summation order)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(2048, 4096, generator=gen, device="cuda") * 4096 ** -0.5).bfloat16()
    x = torch.randn(1, 4096, generator=gen, device="cuda").bfloat16()
    want = torch.nn.functional.linear(x.float(), weight.float())
    for got in (gemv.linear(x, weight).float(), torch.nn.functional.linear(x, weight).float()):
        assert ((got - want).abs().max() / want.abs().max()).item() < 8e-3


def test_gemv_refuses_what_it_does_not_take():
    """Several rows, mixed dtypes and float16 stay with F.linear."""
    w = torch.randn(8, 16)
    assert not gemv.fits(torch.randn(2, 16), w)
    assert not gemv.fits(torch.randn(1, 16, dtype=torch.float64), w.double())
    assert not gemv.fits(torch.randn(1, 16).half(), w)
