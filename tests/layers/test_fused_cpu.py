"""RMSNorm on the CPU through torch's own op (`fused.cpu_rows`): bit for bit the plain ops' result, so a float32 graph
decodes the same tokens whichever path a norm takes."""

from __future__ import annotations

import pytest
import torch

from draftflow.layers.fused import add_rms, cpu_rows, rms
from draftflow.layers.norm import RMSNorm


def plain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dim", [64, 384, 1024, 4096])
@pytest.mark.parametrize("rows", [1, 3, 16, 33])
def test_cpu_rms_equals_the_plain_ops_bit_for_bit(dim, rows):
    gen = torch.Generator().manual_seed(dim * 100 + rows)
    x = torch.randn(2, rows, dim, generator=gen) * torch.rand(2, rows, 1, generator=gen) * 10
    weight = torch.randn(dim, generator=gen)
    assert cpu_rows(x, weight, offset=False)
    assert torch.equal(rms(x, weight, 1e-6), plain(x, weight, 1e-6))
    module = RMSNorm(dim, 1e-6, torch.float32, "cpu")
    module.weight.data.copy_(weight)
    assert torch.equal(module(x), plain(x, weight, 1e-6))
    delta = torch.randn(2, rows, dim, generator=gen)
    assert torch.equal(add_rms(x, delta, weight, 1e-6)[1], plain(x + delta, weight, 1e-6))


def test_other_rows_keep_the_plain_ops():
    x = torch.randn(1, 4, 64)
    assert not cpu_rows(x.bfloat16(), torch.ones(64, dtype=torch.bfloat16), offset=False)  # HF rounds bf16 in between
    assert not cpu_rows(x, torch.ones(64), offset=True)  # Qwen3-Next's (1 + w)
    module = RMSNorm(64, 1e-6, torch.float32, "cpu", offset=True)
    module.weight.data.zero_()
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(module(x), h)
