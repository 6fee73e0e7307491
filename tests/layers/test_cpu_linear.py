"""layers/cpu_linear.py: which float32 CPU products go to oneDNN, and that they compute F.linear's product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftflow.layers import cpu_linear

needs_onednn = pytest.mark.skipif(not cpu_linear.HAS_ONEDNN, reason="this torch build has no oneDNN linear")


@needs_onednn
def test_windows_and_large_weights_go_to_onednn_small_rows_stay_on_f_linear():
    small, large = torch.randn(384, 384), torch.randn(cpu_linear.ONEDNN_WEIGHTS // 384 + 1, 384)
    one, window = torch.randn(1, 1, 384), torch.randn(1, 16, 384)
    assert not cpu_linear.uses_onednn(one, small)  # one row, small weight: MKL is faster
    assert cpu_linear.uses_onednn(one, large)  # one row through an LM-head-sized weight
    assert cpu_linear.uses_onednn(window, small)  # a verify window
    assert not cpu_linear.uses_onednn(window.bfloat16(), small.bfloat16())  # float32 only
    assert not cpu_linear.uses_onednn(window[:, :0], large)  # no rows
    assert not cpu_linear.uses_onednn(window, large.t().contiguous().t())  # a strided weight


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 1, 384), (1, 16, 384), (2, 3, 384), (5, 384)])
def test_the_product_is_f_linears_to_rounding_with_and_without_bias(shape):
    gen = torch.Generator().manual_seed(len(shape))
    x, w, b = torch.randn(shape, generator=gen), torch.randn(2048, 384, generator=gen), torch.randn(2048, generator=gen)
    for bias in (None, b):
        got = cpu_linear.linear(x, w, bias)
        assert got.shape == (*shape[:-1], 2048)
        torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-4, rtol=1e-5)


def test_autograd_and_other_dtypes_take_f_linear_exactly():
    """Training (tensors that need gradients) and non-float32 products are F.linear's, bit for bit."""
    x = torch.randn(1, 16, 384)
    w = torch.randn(640, 384, requires_grad=True)
    out = cpu_linear.linear(x, w)
    assert out.requires_grad and torch.equal(out, F.linear(x, w))
    xb, wb = x.bfloat16(), w.detach().bfloat16()
    assert torch.equal(cpu_linear.linear(xb, wb), F.linear(xb, wb))
