"""The Triton residual-add + RMSNorm and SiLU-gate kernels round where the plain ops round (CUDA)."""

from __future__ import annotations

import pytest
import torch

from draftflow.layers.fused import Kernels, add_rms, rms, silu_mul

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _agree(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=what)
        return
    # bf16: float32 sums in another order may move a value across a rounding boundary: 1 ulp, rarely
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7, msg=what)
    differ = (got != want).float().mean().item()
    assert differ < 0.01, f"{what}: {differ:.1%} of values differ from the plain ops"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("hidden", [64, 4096, 5120])
def test_triton_add_rms_matches_plain_ops(dtype, offset, hidden):
    """x + delta and its RMSNorm (plain or (1 + w) weights, power-of-two or not widths) as the plain ops compute them."""
    gen = torch.Generator(device="cuda").manual_seed(hidden)
    x, delta = (torch.randn(1, 5, hidden, generator=gen, device="cuda").to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(dtype)
    k = Kernels(elementwise=True)
    total, normed = k.add_rms(x, delta, weight, 1e-6, offset)
    want_total, want_normed = add_rms(x, delta, weight, 1e-6, offset)
    torch.testing.assert_close(total, want_total, atol=0, rtol=0)  # one add, one rounding
    _agree(normed, want_normed, "add_rms norm")
    _agree(k.rms(x, weight, 1e-6, offset), rms(x, weight, 1e-6, offset), "rms")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_silu_mul_matches_plain_ops_on_fused_halves(dtype):
    """silu(gate) * up over the two halves of one gate/up product (row-strided views)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(1, 5, 2 * 3000, generator=gen, device="cuda").to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _agree(Kernels(elementwise=True).silu_mul(gate, up), silu_mul(gate, up), "silu_mul")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
def test_rmsnorm_module_takes_the_triton_kernel_outside_autograd(dtype, offset, monkeypatch):
    """`RMSNorm` on CUDA under inference mode is one Triton launch that agrees with its plain ops; with autograd on
    it keeps the plain ops (gradients flow)."""
    from draftflow.layers import triton_kernels
    from draftflow.layers.norm import RMSNorm

    gen = torch.Generator(device="cuda").manual_seed(7)
    norm = RMSNorm(384, 1e-6, dtype, "cuda", offset)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(384, generator=gen, device="cuda"))
    x = torch.randn(2, 16, 384, generator=gen, device="cuda").to(dtype)
    calls = []
    real = triton_kernels.add_rms
    monkeypatch.setattr(triton_kernels, "add_rms", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        got = norm(x)
    assert calls == [1]
    _agree(got, rms(x, norm.weight.detach(), 1e-6, offset), "RMSNorm module")
    with torch.inference_mode():  # no rows (a drafter ingesting nothing): the plain ops, no Triton pointer to give
        assert norm(x[:, :0]).shape == (2, 0, 384) and calls == [1]
    norm.weight.requires_grad_(True)
    norm(x).sum().backward()  # autograd: the plain ops, no Triton launch
    assert calls == [1] and norm.weight.grad is not None
