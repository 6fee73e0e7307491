"""Repacked GGUF weights (layers/quant_repack.py) and their GEMV (layers/quant_gemv_repacked.py) equal gguf's
dequantizer times x.

On the CPU the Triton kernels run under Triton's interpreter on tiny shapes; the CUDA tests pin the compiled
kernels against the file-layout kernels and torch at Qwen3-8B projection shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from torch import nn  # noqa: E402

from draftflow.layers import quant_gemv_repacked as rg  # noqa: E402
from draftflow.layers import quant_kernels as qk  # noqa: E402
from draftflow.layers.triton_kernels import arrival_counters  # noqa: E402
from draftflow.layers import quant_repack as qr  # noqa: E402
from draftflow.layers.fused import fuse_projections, fused_linear  # noqa: E402
from draftflow.layers.quant_linear import LAYOUT, QuantLinear, repack_all  # noqa: E402
from draftflow.tools.kquants import quantize_k  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def weight_bytes(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row bytes] uint8 of an [n, k] N(0, 1) weight: gguf's quantizer, or ours for the K-quants."""
    rows = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return quantize_k(rows, qtype) if qtype.endswith("_K") else gguf.quants.quantize(rows, T[qtype])


def random_bytes(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row bytes] uint8: random quant bytes in the block layout with small finite fp16 scales (fast at 8B sizes)."""
    rng = np.random.default_rng(seed)
    block, size = LAYOUT[qtype]
    data = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for at in {"Q4_K": (0, 2), "Q6_K": (208,)}.get(qtype, (0,)):
        scale = (rng.uniform(2e-3, 1e-2, len(data)) * rng.choice([-1, 1], len(data))).astype(np.float16)
        data[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return data.reshape(n, k // block * size)


def reference(data: np.ndarray, qtype: str) -> torch.Tensor:
    """gguf's numpy dequantization, float32 [n, k]."""
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, T[qtype]), dtype=np.float32))


def _case(qtype: str, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    k = 2 * 256 if LAYOUT[qtype][0] == 256 else 6 * 32  # 32-blocks: 6 (8-bit) or 3 (4-bit) units, not whole steps
    data = weight_bytes(qtype, n, k, seed)
    return qr.repack(torch.from_numpy(data).to(DEV), qtype, k), reference(data, qtype).to(DEV), k


def assert_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None, rtol: float = 1e-5) -> None:
    """got == x @ w.T (+ bias) in float64, to `rtol` of the result's magnitude."""
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rtol * scale, f"max error {err:.3g} against a magnitude {scale:.3g} (rtol {rtol})"


@pytest.mark.parametrize("qtype", qr.RTYPES)
def test_repacked_weights_equal_gguf_bit_for_bit(qtype):
    """Repacking keeps every scale field as the file holds it, so s * c + o is gguf's value exactly (bound 0), in
    torch (`unpack`) and in the Triton dequantization kernel; bfloat16 is that value rounded once."""
    packed, w, k = _case(qtype, 20)
    assert packed.shape == (20, qr.row_bytes(qtype, k)) and packed.shape[1] % 64 == 0
    assert torch.equal(qr.unpack(packed, qtype, k), w)
    assert torch.equal(rg.dequantize(packed, qtype, k, torch.float32, block_n=16), w)
    assert torch.equal(rg.dequantize(packed, qtype, k, torch.bfloat16), w.to(torch.bfloat16))


def test_layout_units_and_bytes_per_weight():
    """Unit u's word i holds weight GW*u + 4j + i in bit field j; the codes are unsigned (Q8_0: q + 128); the bytes
    per weight are the module docstring's (Q4_K 2.8% over the file, Q8_0 equal, Q6_K bytes for 6-bit codes)."""
    q = np.arange(-64, 64, dtype=np.int8).reshape(1, 128)  # Q8_0 codes of 4 blocks, scale 1.0
    blocks = np.zeros((1, 4, 34), np.uint8)
    blocks[0, :, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    blocks[0, :, 2:] = q.view(np.uint8).reshape(4, 32)
    packed = qr.repack(torch.from_numpy(blocks.reshape(1, -1)), "Q8_0", 128)
    words = packed[0, :128].view(torch.int32).view(8, 4)  # [unit, word]
    for u, j, i in ((0, 0, 0), (1, 2, 3), (7, 3, 1)):
        assert (int(words[u, i]) >> (8 * j)) & 255 == int(q[0, 16 * u + 4 * j + i]) + 128
    assert {t: qr.bytes_per_weight(t) for t in ("Q4_K", "Q6_K", "Q8_0")} == \
        {"Q4_K": 0.578125, "Q6_K": 1.0703125, "Q8_0": 1.0625}
    assert qr.row_bytes("Q4_K", 4096) == 2368 and LAYOUT["Q4_K"][1] * 16 == 2304


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q5_1", "Q5_K"])
def test_gemv_rows_and_prefill_path_match_reference(qtype):
    """1 row (factored multiply-adds), 3, 5, 16 (tensor-core dots) and 33 rows, and 70 (dequantize + matmul); at the
    interpreter's wide tile and at the GPU's."""
    packed, w, k = _case(qtype, 20, seed=1)
    gen = torch.Generator().manual_seed(2)
    for m in (1, 3, 5, 16, 33, qk.GEMV_MAX_ROWS + 6):
        x = torch.randn(m, k, generator=gen).to(DEV)
        assert_product(rg.repacked_matmul(x, packed, qtype, k), x, w)
        if m in (1, 16, 33):  # the GPU's tiles (the interpreter's default tile is wider)
            bn, units, warps = rg.tile(m, x.dtype)
            assert_product(rg.gemv(x, packed, qtype, block_n=bn, units=units, num_warps=warps), x, w)
    xb = torch.randn(16, k, generator=gen).to(DEV).to(torch.bfloat16)  # bf16: the weight rounded as a bf16 model's
    for m in (1, 16):
        assert_product(rg.gemv(xb[:m], packed, qtype), xb[:m].float(), w.to(torch.bfloat16).float(), rtol=2e-2)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_split_k_ranges_bias_and_column_slices(qtype):
    """Split-K over rows of 40 Q4_K / 80 Q6_K / 20 Q8_0 units in 8-unit steps (uneven ranges; Q8_0: a half step;
    more ranges asked than steps) at 1, 4, 5, 16 and 33 rows, bias added once, into a column slice of a wider
    bfloat16 output; the fused last-arriver sum equals the separate reduce kernel's and leaves its counters at 0;
    prefetching the next step's tile gives the same bits."""
    n, k = 20, 5 * 256 if qtype != "Q8_0" else 10 * 32
    data = weight_bytes(qtype, n, k, seed=21)
    packed, w = qr.repack(torch.from_numpy(data).to(DEV), qtype, k), reference(data, qtype).to(DEV)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(22)).to(DEV)
    gen = torch.Generator().manual_seed(23)
    assert rg.steps_of(20, 8, 3) == (8, 3)  # Q8_0's 20 units: ranges of 8, 8 and 4
    for m, split in ((1, 3), (4, 2), (5, 99), (16, 3), (33, 2)):
        x = torch.randn(m, k, generator=gen).to(DEV)
        y = rg.gemv(x, packed, qtype, bias, block_n=16, units=8, split_k=split)
        assert_product(y, x, w, bias)
        if m in (1, 16):  # the last-arriving program sums the partials as the second kernel does, bit for bit
            assert torch.equal(y, rg.gemv(x, packed, qtype, bias, block_n=16, units=8, split_k=split,
                                          fused_reduce=False))
        if m == 1:  # loading the next step's tile during this one changes nothing but timing
            assert torch.equal(y, rg.gemv(x, packed, qtype, bias, block_n=16, units=8, split_k=split, prefetch=True))
    assert not arrival_counters(x.device).any()  # every arrival counter is back at zero (this stream's)
    wide = torch.full((4, 3 * n), 7.0, dtype=torch.bfloat16, device=DEV)
    xb = torch.randn(4, k, generator=gen).to(DEV).to(torch.bfloat16)
    y = rg.gemv(xb, packed, qtype, bias, out=wide[:, n:2 * n], block_n=16, units=8, split_k=3)
    assert y.data_ptr() == wide[:, n:].data_ptr() and (wide[:, :n] == 7).all() and (wide[:, 2 * n:] == 7).all()
    assert_product(y, xb.float(), w.to(torch.bfloat16).float(), bias, rtol=2e-2)


def test_split_plan_fills_about_two_waves():
    """split_for: at the Qwen3-8B Q4_K shapes on 132 SMs x 4 resident programs, at least ~2 waves with a small idle
    tail and the fewest ranges among equals; the most ranges when 2 waves cannot be had; never more than allowed."""
    slots = 4 * 132
    for tiles, steps, want in ((96, 16, 16), (64, 16, 16), (384, 16, 4), (64, 48, 16), (16, 32, 32)):
        assert rg.split_for(tiles, steps, slots, 32) == want
    assert rg.split_for(16, 32, slots, 8) == 8 and rg.split_for(4, 1, slots, 32) == 1
    assert rg.split_for(2000, 16, slots, 32) == 1  # the row tiles alone fill 3.8 waves


def test_bad_rows_are_refused_before_a_launch():
    """Repacked bytes of the wrong width, or file bytes that are not whole rows, raise a ValueError naming them."""
    packed, _, k = _case("Q4_K", 4)
    with pytest.raises(ValueError, match=r"repacked Q4_K rows \(4, 256\)"):
        rg.gemv(torch.zeros(1, k, device=DEV), packed[:, :256].contiguous(), "Q4_K")
    with pytest.raises(ValueError, match=r"Q6_K weight bytes \(4, 100\)"):
        qr.repack(torch.zeros(4, 100, dtype=torch.uint8), "Q6_K", 256)


def _linear(qtype: str, n: int, k: int, seed: int) -> tuple[QuantLinear, torch.Tensor]:
    data = weight_bytes(qtype, n, k, seed)
    lin = QuantLinear(qtype, k, n, bias=True, device=DEV)
    lin.blocks.copy_(torch.from_numpy(data))
    lin.bias.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    return lin, reference(data, qtype).to(DEV)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q4_K"), ("Q4_K", "Q4_K", "Q6_K")], ids=["one type", "Q4_K_M mix"])
def test_repacked_quant_linear_fuses_like_the_file_layout(types):
    """QuantLinear.repack frees the file bytes; fuse_projections joins the repacked rows of each run of one type (one
    kernel a run) and fused_linear runs the runs into column slices; products, `dequantized` and the repr follow the
    layout."""
    attn = nn.Module()
    (attn.q_proj, wq), (attn.k_proj, wk), (attn.v_proj, wv) = (
        _linear(t, n, 256, seed) for t, n, seed in zip(types, (32, 16, 16), (7, 8, 9)))
    lins = [attn.q_proj, attn.k_proj, attn.v_proj]
    want, bias = torch.cat([wq, wk, wv]), torch.cat([lin.bias for lin in lins])
    model, layer = nn.Module(), nn.Module()
    layer.self_attn, layer.mlp = attn, nn.Module()
    model.layers = nn.ModuleList([layer])
    assert repack_all(model) == 3
    assert attn.q_proj.blocks is None and "repacked" in repr(attn.q_proj)
    assert torch.equal(attn.v_proj.dequantized(torch.float32), wv)
    fuse_projections(model)
    same = len(set(types)) == 1
    ptr = attn.q_proj.packed.untyped_storage().data_ptr()
    assert attn.k_proj.packed.untyped_storage().data_ptr() == ptr  # q and k: one type in both cases, one kernel
    assert (attn.v_proj.packed.untyped_storage().data_ptr() == ptr) == same
    x = torch.randn(1, 3, 256, generator=torch.Generator().manual_seed(10)).to(DEV)
    y = fused_linear(x, lins)
    assert y.shape == (1, 3, 64)
    assert_product(y.view(3, 64), x.view(3, 256), want, bias)
    assert_product(attn.v_proj(x).view(3, 16), x.view(3, 256), wv, attn.v_proj.bias)


# --- CUDA: the compiled kernels at Qwen3-8B projection shapes -------------------------------
SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("shape", ["qkv", "down"])
def test_cuda_repacked_gemv_against_file_kernel_and_torch(qtype, shape):
    """At 8B shapes the repack (on the GPU) dequantizes to gguf's values; the repacked GEMV (1 row: multiply-adds; 4
    and 16: weight-as-A dots, fused split-K sum; 33: x-as-A dots; bf16 and float32) and the 100-row prefill path
    agree with the file-layout kernels and with torch on the dequantized weight."""
    n, k = SHAPES_8B[shape]
    data = torch.from_numpy(random_bytes(qtype, n, k, seed=11)).cuda()
    packed = qr.repack(data, qtype, k)
    w = qk.dequantize(data, qtype, k, torch.float32)
    assert torch.equal(rg.dequantize(packed, qtype, k, torch.float32), w)
    gen = torch.Generator(device="cuda").manual_seed(12)
    for dtype in (torch.bfloat16, torch.float32):
        wd = w.to(dtype).float()
        for m in (1, 4, 16, 33, 100):  # 100: the prefill path (dequantize + cuBLAS)
            x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
            got, old = rg.repacked_matmul(x, packed, qtype, k), qk.quant_matmul(x, data, qtype, k)
            rtol = 1e-5 if dtype == torch.float32 else 1e-2
            assert got.dtype == dtype
            assert_product(got, x.float(), wd if m > 1 else w, rtol=rtol)
            assert (got.float() - old.float()).abs().max() <= 2 * rtol * old.float().abs().max()
