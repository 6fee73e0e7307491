"""The GGUF-quantized matrix products (layers/quant_kernels.py) equal gguf's dequantizer times x.

On the CPU the Triton kernels run under Triton's interpreter on tiny shapes; the CUDA tests
run the compiled kernels at Qwen3-8B projection widths.
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

from draftflow.layers import quant_gemv as qg  # noqa: E402
from draftflow.layers import quant_kernels as qk  # noqa: E402
from draftflow.layers.fused import fuse_projections, fused_linear  # noqa: E402
from draftflow.layers.quant_linear import LAYOUT, QTYPES, QuantLinear  # noqa: E402

QUANTIZABLE = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}  # gguf.quants.quantize has these; K-quants are built from bytes
FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # d (and dmin) in each block
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def weight_bytes(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row bytes] uint8 of an [n, k] weight: gguf's quantizer on N(0, 1) values, or random bytes to the block
    layout with small finite fp16 scales (K-quants: gguf cannot quantize them)."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), T[qtype])
    block, size = LAYOUT[qtype]
    data = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        scale = (rng.uniform(2e-3, 1e-2, len(data)) * rng.choice([-1, 1], len(data))).astype(np.float16)
        data[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return data.reshape(n, k // block * size)


def reference(data: np.ndarray, qtype: str) -> torch.Tensor:
    """gguf's numpy dequantization, float32 [n, k]."""
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, T[qtype]), dtype=np.float32))


def assert_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None, rtol: float = 1e-5) -> None:
    """got == x @ w.T (+ bias) in float64, to `rtol` of the result's magnitude."""
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rtol * scale, f"max error {err:.3g} against a magnitude {scale:.3g} (rtol {rtol})"


def _case(qtype: str, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    k = 2 * LAYOUT[qtype][0] if LAYOUT[qtype][0] == 256 else 4 * 32  # two loop iterations either way
    data = weight_bytes(qtype, n, k, seed)
    return torch.from_numpy(data).to(DEV), reference(data, qtype).to(DEV), k


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_equals_gguf(qtype):
    """The in-kernel dequantization of every covered type equals gguf.quants.dequantize bit for bit (float32)."""
    blocks, w, k = _case(qtype, 20)  # 20 rows: a partial block of output features
    assert torch.equal(qk.dequantize(blocks, qtype, k, torch.float32, block_n=16), w)
    assert torch.equal(qk.dequantize(blocks, qtype, k, torch.bfloat16), w.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", QTYPES)
def test_gemv_rows_and_prefill_path_match_reference(qtype):
    """1, 5, 16 and 33 rows (GEMV: float32 FMAs, then tensor-core dots) and 70 rows (dequantize + matmul)."""
    blocks, w, k = _case(qtype, 20, seed=1)
    gen = torch.Generator().manual_seed(2)
    for m in (1, 5, 16, 33, qk.GEMV_MAX_ROWS + 6):
        x = torch.randn(m, k, generator=gen).to(DEV)
        assert_product(qk.quant_matmul(x, blocks, qtype, k), x, w)
        if m <= qk.GEMV_MAX_ROWS:  # the GPU's tile (the interpreter's default tile is wider)
            assert_product(qk.gemv(x, blocks, qtype, block_n=qg.tile(m, x.dtype)[0]), x, w)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_split_k_ranges_rows_and_slices(qtype):
    """Split-K over rows of 6 Q8_0 / 5 K-quant blocks (ranges of unequal length; more ranges asked than the row has
    steps) at 1, 4, 5, 16, 33 and 64 rows, bias added once, into a column slice of a wider bfloat16 output."""
    n, k = 20, 6 * 32 if qtype == "Q8_0" else 5 * 256
    data = weight_bytes(qtype, n, k, seed=21)
    blocks, w = torch.from_numpy(data).to(DEV), reference(data, qtype).to(DEV)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(22)).to(DEV)
    gen = torch.Generator().manual_seed(23)
    unroll = qk._meta(qtype, k // qk.LAYOUT[qtype][0])["UNROLL"]
    assert qg.split_ranges(k // qk.LAYOUT[qtype][0], unroll, 2)[1] == 2  # the row splits, unevenly
    for m, split in ((1, 2), (4, 3), (5, 2), (16, 99), (33, 3), (64, 2)):
        x = torch.randn(m, k, generator=gen).to(DEV)
        assert_product(qg.gemv(x, blocks, qtype, bias, block_n=16, split_k=split), x, w, bias)
    wide = torch.full((4, 3 * n), 7.0, dtype=torch.bfloat16, device=DEV)
    xb = torch.randn(4, k, generator=gen).to(DEV).to(torch.bfloat16)
    y = qg.gemv(xb, blocks, qtype, bias, out=wide[:, n:2 * n], block_n=16, split_k=3)
    assert y.data_ptr() == wide[:, n:].data_ptr() and (wide[:, :n] == 7).all() and (wide[:, 2 * n:] == 7).all()
    assert_product(y, xb.float(), w.to(torch.bfloat16).float(), bias, rtol=2e-2)


def test_bias_batch_dims_and_bf16():
    """[B, T, K] inputs keep their leading dims, a bias is added, bfloat16 in gives bfloat16 out near the bf16 model."""
    blocks, w, k = _case("Q4_K", 24, seed=3)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(4)).to(DEV)
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(5)).to(DEV)
    y = qk.quant_matmul(x, blocks, "Q4_K", k, bias)
    assert y.shape == (2, 3, 24)
    assert_product(y.view(6, 24), x.view(6, k), w, bias)
    for m in (1, 8):  # CUDA-core and tensor-core GEMV in bfloat16
        xb = x.view(6, k)[:m].to(torch.bfloat16)
        yb = qk.quant_matmul(xb, blocks, "Q4_K", k)
        assert yb.dtype == torch.bfloat16
        assert_product(yb, xb.float(), w.to(torch.bfloat16).float(), rtol=2e-2)


def test_bad_bytes_are_refused_before_a_launch():
    """Weight bytes that are not whole rows of the type raise a ValueError naming the type and shapes."""
    blocks, _, k = _case("Q6_K", 4)
    with pytest.raises(ValueError, match=r"Q6_K weight bytes \(4, 419\)"):
        qk.quant_matmul(torch.zeros(1, k, device=DEV), blocks[:, :-1], "Q6_K", k)


def _quant_linear(qtype: str, n: int, k: int, seed: int, bias: bool = False) -> tuple[QuantLinear, torch.Tensor]:
    data = weight_bytes(qtype, n, k, seed)
    lin = QuantLinear(qtype, k, n, bias=bias, device=DEV)
    lin.blocks.copy_(torch.from_numpy(data))
    if bias:
        lin.bias.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    return lin, reference(data, qtype).to(DEV)


class _Attn(nn.Module):
    def __init__(self, types: tuple[str, str, str], k: int) -> None:
        super().__init__()
        (self.q_proj, wq), (self.k_proj, wk), (self.v_proj, wv) = (
            _quant_linear(t, n, k, seed, bias=True) for t, n, seed in zip(types, (32, 16, 16), (7, 8, 9)))
        self.want = torch.cat([wq, wk, wv])
        self.bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q4_K"), ("Q4_K", "Q4_K", "Q6_K")], ids=["one type", "Q4_K_M mix"])
def test_fused_qkv_of_quantized_projections(types):
    """fused_linear gives q/k/v as one [.., 64] tensor: one joined product when the blocks share a type
    (fuse_projections concatenates their rows), else one kernel per run of one type into column slices."""
    attn = _Attn(types, 256)
    model = nn.Module()
    layer = nn.Module()
    layer.self_attn, layer.mlp = attn, nn.Module()
    model.layers = [layer]
    fuse_projections(model)
    same = len(set(types)) == 1
    ptr = attn.q_proj.blocks.untyped_storage().data_ptr()
    assert attn.k_proj.blocks.untyped_storage().data_ptr() == ptr  # q and k: one type in both cases, one kernel
    assert (attn.v_proj.blocks.untyped_storage().data_ptr() == ptr) == same
    x = torch.randn(1, 3, 256, generator=torch.Generator().manual_seed(10)).to(DEV)
    y = fused_linear(x, [attn.q_proj, attn.k_proj, attn.v_proj])
    assert y.shape == (1, 3, 64)
    assert_product(y.view(3, 64), x.view(3, 256), attn.want, attn.bias)
    assert_product(attn.v_proj(x).view(3, 16), x.view(3, 256), attn.want[48:], attn.bias[48:])


# --- CUDA: the compiled kernels at Qwen3-8B projection shapes -------------------------------
SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_at_8b_shapes(qtype, dtype):
    """Compiled GEMV (1, 4, 5, 16, 33, 64 rows) and the prefill path (300 rows) against gguf's dequantization."""
    n, k = SHAPES_8B["down"] if qtype in ("Q4_K", "Q6_K") else (1024, 4096)
    data = weight_bytes(qtype, n, k, seed=11)
    blocks, w = torch.from_numpy(data).cuda(), reference(data, qtype).cuda()
    assert torch.equal(qk.dequantize(blocks, qtype, k, torch.float32), w)
    wd = w.to(dtype).float()  # what a model dequantized at load in `dtype` multiplies by
    gen = torch.Generator(device="cuda").manual_seed(12)
    for m in (1, 4, 5, 16, 33, 64, 300):
        x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
        y = qk.quant_matmul(x, blocks, qtype, k)
        assert y.dtype == dtype
        assert_product(y, x.float(), wd, rtol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("repacked", [False, True], ids=["file-blocks", "repacked"])
@pytest.mark.parametrize("m", [1, 16])
def test_cuda_gemv_replays_in_a_cuda_graph(m, repacked):
    """A captured quantized product (split-K partials and their sum) replays with new inputs and gives the eager
    result (no host sync inside), with the file's blocks and repacked (layers/quant_repack.py)."""
    lin, _ = _quant_linear("Q4_K", 4096, 4096, seed=13)
    if repacked:
        lin.repack()
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    lin(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lin(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(y, lin(x), atol=0, rtol=0)
