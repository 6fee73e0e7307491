"""Triton matrix products that read GGUF-quantized weights in their block layout (issue 20, item 2).

A weight [N, K] is stored as the file stores it: row n is K/BS blocks of BB bytes
(`quant_linear.LAYOUT`). Each kernel dequantizes one *part* of a block at a time (a run of
16 or 32 consecutive weights whose quants sit in contiguous bytes at one bit shift, with
one scale per row) into float32 registers, exactly as gguf-py's numpy dequantizer computes
it (`d * q`, `(d * sc) * q - dmin * m`, ...), and never writes it to memory:

- `gemv` (decode and verify windows, M <= GEMV_MAX_ROWS rows; `quant_gemv`): split-K, one
  program per BLOCK_N output features and a range of the row's blocks, every weight byte read
  once for all M rows. Up to quant_gemv.DOT_MIN_ROWS - 1 rows the products are float32
  multiply-adds; from DOT_MIN_ROWS rows a tensor-core `tl.dot` per part (bfloat16 weights rounded
  as a dequantized-at-load bfloat16 model holds them; float32 models multiply in IEEE float32).
  Accumulation is float32 in both.
- larger M (prefill): `dequantize` writes the weight in the activation dtype to a scratch
  tensor (torch's caching allocator reuses it) and torch.matmul (cuBLAS) multiplies. At
  prefill sizes the product is compute-bound, so the extra write and read of the scratch
  costs little next to cuBLAS's GEMM.

Part layouts (weight j of a block; bytes relative to the block):
  Q8_0 (34 B): d f16 @0, int8 q[j] @2+j;                              w = d*q
  Q4_0 (18 B): d @0, byte @2+(j%16), nibble j//16;                    w = d*(q-8)
  Q4_1 (20 B): d @0, m @2, nibbles @4;                                w = d*q + m
  Q5_0 (22 B): d @0, high bit j of the little-endian u32 @2, nibbles @6; w = d*(q-16)
  Q5_1 (24 B): d @0, m @2, high bits @4, nibbles @8;                  w = d*q + m
  Q4_K (144 B, 8 sub-blocks s of 32): d @0, dmin @2, 6-bit scales/mins packed in 12 bytes @4,
       byte @16+32*(s//2)+l, nibble s%2;                               w = (d*sc[s])*q - dmin*mn[s]
  Q5_K (176 B): as Q4_K, high bit s of byte @16+l, nibbles @48+32*(s//2)+l
  Q6_K (210 B): low nibbles @0 (byte 64*(s//4)+32*(s%2)+l, nibble (s%4)//2), 2 high bits @128
       (byte 32*(s//4)+l, shift 2*(s%4)), int8 scale per 16 weights @192, d @208; w = (d*sc)*(q-32)

Imported lazily (on a QuantLinear's first product); on the CPU the kernels run only under
Triton's interpreter (TRITON_INTERPRET=1, the tests).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from draftflow.layers.quant_linear import LAYOUT, QTYPES
from draftflow.layers.triton_kernels import round_like

GEMV_MAX_ROWS = 64  # rows (tokens of all batch rows) that take the GEMV; more: dequantize + cuBLAS
_CODE = {name: i for i, name in enumerate(QTYPES)}  # the kernels' QTYPE constant
# Triton's CPU interpreter truncates float32 -> bfloat16 and mis-multiplies bfloat16 it converted itself, so there
# the kernels round on the bits (as the GPU's round-to-nearest-even does) and multiply the rounded values in float32.
# The interpreter also pays per program, not per element: it runs wide tiles (the tests pin BLOCK_N 16 explicitly).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
PARTS = {"Q8_0": (32, 1), "Q4_0": (16, 2), "Q4_1": (16, 2), "Q5_0": (16, 2), "Q5_1": (16, 2),
         "Q4_K": (32, 8), "Q5_K": (32, 8), "Q6_K": (32, 8)}  # (weights per part, parts per block)


@triton.jit
def _byte(ptr):
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _half(ptr):
    # A little-endian float16 at byte `ptr` (read byte-wise: the compiler cannot prove 2-byte alignment) -> float32
    bits = _byte(ptr) | (_byte(ptr + 1) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f32(v):
    # int32 |v| < 2^22 -> float32, exactly (every such integer is a float32): 1.5 * 2^23 + v carries v in its low
    # mantissa bits, so one integer add and one float subtract replace the int -> float conversion instruction,
    # which runs at a quarter of the FMA rate and would cap the GEMV's weights per cycle below the memory's.
    return (v + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _int8(ptr):
    return _f32((_byte(ptr) ^ 128) - 128)


@triton.jit
def _k_scale_min(blk, S: tl.constexpr):
    # Q4_K / Q5_K: sub-block S's 6-bit scale and min from the 12 packed bytes at blk+4 (gguf Q4_K.get_scale_min):
    # S < 4: low 6 bits of bytes S and S+4; S >= 4: a nibble of byte S+4 and the top 2 bits of bytes S-4 and S.
    if S < 4:
        sc = _byte(blk + 4 + S) & 63
        mn = _byte(blk + 8 + S) & 63
    else:
        sc = (_byte(blk + 8 + S) & 15) | ((_byte(blk + S) >> 6) << 4)
        mn = (_byte(blk + 8 + S) >> 4) | ((_byte(blk + 4 + S) >> 6) << 4)
    return _f32(sc), _f32(mn)


@triton.jit
def _part(blk, S: tl.constexpr, lanes, QTYPE: tl.constexpr):
    # blk: [BN, 1] byte pointers to one block of each row; lanes: arange(P). Returns weights S*P .. S*P+P-1
    # of the block, [BN, P] float32, rounded as gguf's numpy dequantizer rounds them.
    l = lanes[None, :]
    if QTYPE == 0:  # Q8_0
        w = _half(blk) * _int8(blk + 2 + l)
    elif QTYPE == 1:  # Q4_0
        q = (_byte(blk + 2 + l) >> (4 * S)) & 15
        w = _half(blk) * _f32(q - 8)
    elif QTYPE == 2:  # Q4_1
        q = (_byte(blk + 4 + l) >> (4 * S)) & 15
        w = _half(blk) * _f32(q) + _half(blk + 2)
    elif QTYPE == 3:  # Q5_0
        j = S * 16 + l
        q = ((_byte(blk + 6 + l) >> (4 * S)) & 15) | (((_byte(blk + 2 + (j >> 3)) >> (j & 7)) & 1) << 4)
        w = _half(blk) * _f32(q - 16)
    elif QTYPE == 4:  # Q5_1
        j = S * 16 + l
        q = ((_byte(blk + 8 + l) >> (4 * S)) & 15) | (((_byte(blk + 4 + (j >> 3)) >> (j & 7)) & 1) << 4)
        w = _half(blk) * _f32(q) + _half(blk + 2)
    elif QTYPE == 5:  # Q4_K
        sc, mn = _k_scale_min(blk, S)
        q = (_byte(blk + 16 + 32 * (S // 2) + l) >> (4 * (S % 2))) & 15
        w = (_half(blk) * sc) * _f32(q) - _half(blk + 2) * mn
    elif QTYPE == 6:  # Q5_K
        sc, mn = _k_scale_min(blk, S)
        q = ((_byte(blk + 48 + 32 * (S // 2) + l) >> (4 * (S % 2))) & 15) | (((_byte(blk + 16 + l) >> S) & 1) << 4)
        w = (_half(blk) * sc) * _f32(q) - _half(blk + 2) * mn
    else:  # Q6_K
        lo = (_byte(blk + 64 * (S // 4) + 32 * (S % 2) + l) >> (4 * ((S % 4) // 2))) & 15
        hi = (_byte(blk + 128 + 32 * (S // 4) + l) >> (2 * (S % 4))) & 3
        sc = tl.where(l < 16, _int8(blk + 192 + 2 * S), _int8(blk + 193 + 2 * S))  # one scale per 16 weights
        w = (_half(blk + 208) * sc) * _f32((lo | (hi << 4)) - 32)
    return w


@triton.jit
def _dequant_kernel(
    w_ptr, out_ptr, N, K, row_bytes,
    QTYPE: tl.constexpr, BS: tl.constexpr, BB: tl.constexpr, P: tl.constexpr, NPART: tl.constexpr,
    UNROLL: tl.constexpr, BLOCK_N: tl.constexpr, OUT_BF16: tl.constexpr,
):
    # w: [N, row_bytes] uint8 -> out: [N, K]; one program per (BLOCK_N rows, UNROLL blocks)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, N - 1)
    wrow = w_ptr + safe.to(tl.int64)[:, None] * row_bytes
    orow = out_ptr + safe.to(tl.int64)[:, None] * K
    live = rows[:, None] < N
    lanes = tl.arange(0, P)
    for u in tl.static_range(UNROLL):
        b = tl.program_id(1) * UNROLL + u
        blk = wrow + b * BB
        for s in tl.static_range(NPART):
            w = round_like(_part(blk, s, lanes, QTYPE), OUT_BF16)
            tl.store(orow + (b * BS + s * P) + lanes[None, :], w.to(out_ptr.dtype.element_ty), mask=live)


def _meta(qtype: str, n_blocks: int) -> dict:
    block, size = LAYOUT[qtype]
    p, parts = PARTS[qtype]
    # Several blocks per loop iteration (as many as divide the row): more independent loads in flight per program
    unroll = next(u for u in ((8, 4, 2, 1) if block == 32 else (4, 2, 1)) if n_blocks % u == 0)
    return dict(QTYPE=_CODE[qtype], BS=block, BB=size, P=p, NPART=parts, UNROLL=unroll)


def _check(blocks: torch.Tensor, qtype: str, in_features: int) -> int:
    if qtype not in LAYOUT:
        raise ValueError(f"no quantized kernel for {qtype}; expected one of {', '.join(QTYPES)}")
    block, size = LAYOUT[qtype]
    if in_features % block or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
            or blocks.shape[1] != in_features // block * size or blocks.stride(1) != 1:
        raise ValueError(f"{qtype} weight bytes {tuple(blocks.shape)} ({blocks.dtype}) do not hold rows of "
                         f"{in_features} weights ({size} bytes per {block}); expected [N, {in_features // block * size}] uint8")
    return in_features // block


def gemv(x: torch.Tensor, blocks: torch.Tensor, qtype: str, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, **tile) -> torch.Tensor:  # [M, N] in x.dtype
    """x @ W^T reading every weight byte once for all M rows (M <= GEMV_MAX_ROWS): `quant_gemv.gemv`."""
    from draftflow.layers.quant_gemv import gemv as split_k_gemv

    return split_k_gemv(x, blocks, qtype, bias, out, **tile)


def dequantize(blocks: torch.Tensor, qtype: str, in_features: int, dtype: torch.dtype,
               block_n: int = 32 if not _INTERPRETED else 256, out: torch.Tensor | None = None) -> torch.Tensor:  # [N, K]
    """The weight of `blocks` [N, row bytes] as an [N, in_features] tensor of `dtype` (gguf's values, then cast);
    `out`: a contiguous [N, in_features] tensor of `dtype` on the blocks' device to write instead of a new one."""
    n_blocks = _check(blocks, qtype, in_features)
    n = blocks.shape[0]
    if out is None:
        out = torch.empty(n, in_features, dtype=dtype, device=blocks.device)
    elif out.shape != (n, in_features) or out.dtype != dtype or not out.is_contiguous() or out.device != blocks.device:
        raise ValueError(f"dequantize out: expected a contiguous [{n}, {in_features}] {dtype} tensor on {blocks.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    meta = _meta(qtype, n_blocks)
    _dequant_kernel[(triton.cdiv(n, block_n), n_blocks // meta["UNROLL"])](
        blocks, out, n, in_features, blocks.stride(0), **meta, BLOCK_N=block_n, OUT_BF16=dtype == torch.bfloat16,
        num_warps=4,
    )
    return out


def quant_matmul(
    x: torch.Tensor,  # [..., K]
    blocks: torch.Tensor,  # [N, K/BS*BB] uint8
    qtype: str,
    in_features: int,
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [rows of x, N] view to write into (unit column stride)
) -> torch.Tensor:  # [..., N] in x.dtype (`out` itself when given)
    """x @ W^T (+ bias) for a GGUF-quantized W: the GEMV up to GEMV_MAX_ROWS rows, else dequantize + torch.matmul."""
    return matmul_with(gemv, dequantize, x, blocks, qtype, in_features, bias, out)


def matmul_with(gemv_fn, dequantize_fn, x, weight, qtype, in_features, bias=None, out=None) -> torch.Tensor:
    """x @ W^T (+ bias) for W in a quantized device layout (``weight`` [N, row bytes]), given that layout's
    ``gemv_fn(x2, weight, qtype, bias, out)`` and ``dequantize_fn(weight, qtype, in_features, dtype)``: the GEMV up
    to GEMV_MAX_ROWS rows of x, else dequantize + torch's matmul."""
    x2 = x.reshape(-1, in_features)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    if m == 0:
        y = torch.empty(0, n, dtype=x.dtype, device=x.device) if out is None else out
    elif m <= GEMV_MAX_ROWS:
        y = gemv_fn(x2, weight, qtype, bias, out)
    else:
        y = F.linear(x2, dequantize_fn(weight, qtype, in_features, x.dtype), bias)  # [M, N]
        if out is not None:
            y = out.copy_(y)
    return y if out is not None else y.view(*x.shape[:-1], n)
