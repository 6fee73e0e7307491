"""Split-K GEMV over GGUF-quantized weights: decode and verify windows (issue 20, item 2).

x [M, K] times W^T for W [N, K] in its GGUF block layout, M <= quant_kernels.GEMV_MAX_ROWS. The
weight is the only large read, so the kernel is bound by how many weight bytes are in flight on
each SM. A program owns BLOCK_N output features *and one contiguous range of their super-blocks*
(grid: N / BLOCK_N tiles by SPLIT ranges of the row), so even the 4096-row projections of an 8B
model launch several programs per SM, each with a short loop of UNROLL blocks x all parts of
independent loads. Every weight byte is still read once for all M rows (all rows sit in one
program). The dequantization is `quant_kernels._part`, unchanged (gguf's values bit for bit).

- SPLIT == 1 (enough row tiles already): the program adds the bias, rounds and stores, as before.
- SPLIT > 1: each program stores its float32 partial sums to a scratch [SPLIT, M, N]; a second small
  kernel adds the SPLIT partials in a fixed order (deterministic, no atomics), adds the bias, rounds
  once to the output dtype and stores into `out` (a column slice of a wider output is fine). Both
  launches are CUDA-graph capturable (no host sync, the scratch comes from torch's allocator).

`plan` picks (BLOCK_N, warps, SPLIT) from the shape: SPLIT so that the grid has about
PROGRAMS_PER_SM programs per SM, capped so the partials' write + read stays a small fraction of the
weight bytes (it grows with M), and so that every range holds whole UNROLL steps.
Up to DOT_MIN_ROWS - 1 rows the products are float32 multiply-adds; from DOT_MIN_ROWS rows one
tensor-core `tl.dot` per part (see quant_kernels' docstring for the rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftflow.layers.quant_kernels import _INTERPRETED, _check, _meta, _part
from draftflow.layers.triton_kernels import round_like, multiprocessors

DOT_MIN_ROWS = 5  # from this many rows the GEMV multiplies on tensor cores
# (output features per program, warps) of the multiply-add path by rows (<= 2, 3-4) and of the tl.dot path
# (which needs >= 16 features). The tl.dot path re-reads x [M, range] per program from L2, so it takes wider tiles.
GEMV_TILES = {False: (16, 2), True: (64, 4)}
GEMV_TILES_FMA_4 = (32, 4)  # 3-4 rows: lanes_acc is [M, BLOCK_N, P] float32 (32 registers a thread)
GEMV_TILES_DOT_WIDE = (32, 4)  # bf16 tl.dot with more than 16 rows (64 features, 64 rows: > 255 registers)
GEMV_TILES_DOT_FP32 = (16, 8)  # IEEE float32 tl.dot (CUDA-core products; at 4 warps: 255 registers and spills)
# Target grid: the split brings the grid up to this many programs per SM (sm_90 compile, 8B shapes: 56-190 registers,
# no spills, so 2-16 programs of 2-4 warps fit on an SM at once; each program's one loop step reads 4.3-54 KB).
PROGRAMS_PER_SM = 16
PARTIAL_SHARE = 0.25  # the partials' write + read (8 * SPLIT * M bytes a row) at most this share of the row's bytes
MAX_SPLIT = 16
REDUCE_BLOCK = 512


def tile(m: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, warps) for m rows of `dtype` activations."""
    if m < DOT_MIN_ROWS:
        return GEMV_TILES_FMA_4 if m >= 3 else GEMV_TILES[False]
    if dtype == torch.float32:
        return GEMV_TILES_DOT_FP32
    return GEMV_TILES_DOT_WIDE if m > 16 else GEMV_TILES[True]


def _wide(m: int, dtype: torch.dtype) -> bool:
    return m >= DOT_MIN_ROWS and (m > 16 or dtype == torch.float32)


def meta(qtype: str, n_blocks: int, m: int, dtype: torch.dtype) -> dict:
    """quant_kernels._meta, with one block per loop step for the wide tl.dot tiles (more: > 255 registers, spills)."""
    out = _meta(qtype, n_blocks)
    if _wide(m, dtype):
        out["UNROLL"] = 1 if out["BS"] == 256 else next(u for u in (2, 1) if n_blocks % u == 0)
    return out


def plan(m: int, n: int, qtype: str, n_blocks: int, device: torch.device,
         dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int]:
    """(BLOCK_N, warps, SPLIT) for an [m, K] x [n, K]^T product of `qtype` rows of `n_blocks` blocks."""
    block_n, warps = tile(m, dtype)
    if _INTERPRETED:  # the interpreter pays per program: wide tiles, and a split of 2 so the tests cover it
        return 256, warps, 2
    steps = n_blocks // meta(qtype, n_blocks, m, dtype)["UNROLL"]  # the row in UNROLL-block steps
    sms = multiprocessors(device)
    want = triton.cdiv(PROGRAMS_PER_SM * sms, triton.cdiv(n, block_n))
    row_bytes = n_blocks * _meta(qtype, n_blocks)["BB"]
    cap = max(1, int(PARTIAL_SHARE * row_bytes / (8 * m)))
    if want <= 2:  # enough row tiles already: one launch, no partials
        return block_n, warps, 1
    return block_n, warps, max(1, min(want, cap, steps, MAX_SPLIT))


def split_ranges(n_blocks: int, unroll: int, split: int) -> tuple[int, int]:
    """(blocks per range, ranges): ranges of whole UNROLL steps covering the row, none of them empty."""
    steps = n_blocks // unroll
    per = triton.cdiv(steps, max(1, min(split, steps))) * unroll
    return per, triton.cdiv(n_blocks, per)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, M, N, row_bytes, n_blocks, blocks_per_split, stride_xm, stride_om,
    QTYPE: tl.constexpr, BS: tl.constexpr, BB: tl.constexpr, P: tl.constexpr, NPART: tl.constexpr,
    UNROLL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr,
    NATIVE: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
):
    # x: [M, K] (unit column stride); w: [N, row_bytes] uint8; program (i, s): features i*BLOCK_N.. over blocks
    # s*blocks_per_split .. (a multiple of UNROLL; the last range ends at n_blocks). Rows past N read row N-1 (no masks
    # on the weight) and are not stored. DIRECT: bias, round, store to out [M, N]; else float32 partials
    # part [SPLIT, M, N] at s.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    safe = tl.minimum(rows, N - 1)
    wrow = w_ptr + safe.to(tl.int64)[:, None] * row_bytes  # [BN, 1]
    ms = tl.arange(0, BLOCK_M)
    live = ms[:, None] < M
    xrow = x_ptr + ms[:, None] * stride_xm  # [BM, 1]
    lanes = tl.arange(0, P)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if not USE_DOT:  # multiply-adds into per-lane partial sums, reduced once at the end
        lanes_acc = tl.zeros([BLOCK_M, BLOCK_N, P], dtype=tl.float32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, n_blocks)
    for i in range(first, last, UNROLL):
        for u in tl.static_range(UNROLL):
            blk = wrow + (i + u) * BB
            for s in tl.static_range(NPART):
                w = _part(blk, s, lanes, QTYPE)  # [BN, P] float32
                x = tl.load(xrow + ((i + u) * BS + s * P) + lanes[None, :], mask=live, other=0.0)  # [BM, P]
                if USE_DOT:
                    if IEEE:  # float32 activations: IEEE float32 products, as a float32 model's matmul
                        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                    elif NATIVE:  # 16-bit activations: the weight rounded as a dequantized 16-bit model holds it
                        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
                    else:  # (interpreter) the same products in float32
                        acc += tl.dot(x.to(tl.float32), tl.trans(round_like(w, True)), input_precision="ieee")
                else:
                    lanes_acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
    if not USE_DOT:
        acc = tl.sum(lanes_acc, axis=2)
    store = live & (rows[None, :] < N)
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + safe).to(tl.float32)[None, :]
        acc = round_like(acc, OUT_BF16)
        tl.store(out_ptr + ms[:, None] * stride_om + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=store)
    else:
        tl.store(part_ptr + (split * M + ms[:, None]) * N + rows[None, :], acc, mask=store)


@triton.jit
def _reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                   HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr):
    # part: [SPLIT, M, N] float32 -> out row m, columns of this program: the SPLIT partials in order (+ bias), rounded
    m = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = cols < N
    acc = tl.load(part_ptr + m * N + cols, mask=live, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + (s * M + m) * N + cols, mask=live, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=live, other=0.0).to(tl.float32)
    acc = round_like(acc, OUT_BF16)
    tl.store(out_ptr + m * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=live)


def gemv(
    x: torch.Tensor,  # [M, K], unit column stride
    blocks: torch.Tensor,  # [N, K/BS*BB] uint8
    qtype: str,
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [M, N], unit column stride (a column slice of a wider output is fine)
    block_n: int | None = None,  # None: `plan`
    num_warps: int | None = None,
    split_k: int | None = None,  # ranges of the row (None: `plan`); at most the row's UNROLL steps are used
) -> torch.Tensor:  # [M, N] in x.dtype
    """x @ W^T reading every weight byte once for all M rows (M <= GEMV_MAX_ROWS)."""
    m, k = x.shape
    n_blocks = _check(blocks, qtype, k)
    n = blocks.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    use_dot = m >= DOT_MIN_ROWS
    tile_n, warps, split = plan(m, n, qtype, n_blocks, x.device, x.dtype)
    block_n, num_warps, split = block_n or tile_n, num_warps or warps, split_k or split
    consts = meta(qtype, n_blocks, m, x.dtype)
    per, split = split_ranges(n_blocks, consts["UNROLL"], split)
    block_m = max(16, triton.next_power_of_2(m)) if use_dot else triton.next_power_of_2(m)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    common = dict(HAS_BIAS=bias is not None, OUT_BF16=out.dtype == torch.bfloat16)
    _gemv_kernel[(triton.cdiv(n, block_n), split)](
        x, blocks, bias if bias is not None else x, out, part, m, n, blocks.stride(0), n_blocks, per, x.stride(0),
        out.stride(0), **consts, BLOCK_M=block_m, BLOCK_N=block_n, USE_DOT=use_dot, IEEE=x.dtype == torch.float32,
        NATIVE=not _INTERPRETED, DIRECT=split == 1, **common, num_warps=num_warps,
    )
    if split > 1:
        _reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK), m)](
            part, bias if bias is not None else part, out, m, n, out.stride(0), SPLIT=split, BLOCK=REDUCE_BLOCK,
            **common, num_warps=4,
        )
    return out
