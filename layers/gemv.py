"""A one-row GEMV for plain bf16 / float32 weights, for the decode-step projections where it beats cuBLAS.

At one token a projection is a memory-bound GEMV. cuBLAS runs the large ones near copy
bandwidth, but the small ones of a MoE or hybrid layer (the 30B-A3B shape's o_proj: 2048 x 4096,
16.8 MB) take a split-K kernel plus a separate reduce launch and reach about half of it. Here a
program owns BLOCK_N output features and a K chunk, accumulates [BLOCK_N, BLOCK_K] float32
products in registers (one reduction at the end), and the split-K partials of a tile are summed
in a fixed order by the last of its programs to arrive (an acquire-release counter per tile, left
at zero): one launch, deterministic, no host sync, CUDA-graph capturable.

`linear(x, weight)` computes `F.linear(x, weight)` for x [1, K] (any leading dims of one row);
the output is rounded once from the float32 sum, as cuBLAS rounds its accumulator. Which
products take it is measured, not assumed (`benchmarks/gpu_gemv.py`, H200, bf16, 2026-12-01,
one product timed in CUDA graphs over weights that do not fit in L2): it beats cuBLAS on the
attention output projections, 30B-A3B's 2048 x 4096 (7.96 against 9.26 us) and Qwen3-8B's
4096 x 4096 (12.35 against 13.35 us), and loses where N > K (q/k/v: 8.8 against 8.0 us at
5120 x 2048) and on large weights (8B down: 30.0 against 29.2 us; gate/up 52.6 against 49.5).
So `prefer` takes a weight with K >= N of at most PREFER_MAX_BYTES. The decoder offers every
one-row dense product (fused q/k/v and gate/up through `fused.Kernels.matmul`, o_proj and down_proj
through `Kernels.project`, with the Triton elementwise kernels on CUDA) and `prefer` picks: at
Qwen3-8B shapes that is o_proj alone. Taking every product instead, chained by PDL (`PREFER_ALL`,
`python benchmarks/gpu_quant.py --quick --configs bf16,q4_k_m+r --gemv-all ...`, 2026-12-02),
made the bf16 step slower: 4.912 against 4.615 ms (`benchmarks/results/h200_gpu_quant_gemv_all.json`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftflow.layers.triton_kernels import COUNTERS, arrival_counters, multiprocessors, pdl, pdl_enter

BLOCK_N = 4  # output features per program, x BLOCK_K of K per step: the best tile for both o_proj shapes below
BLOCK_K = 1024
PROGRAMS_PER_SM = 4  # split K until tiles x chunks fill this many programs per multiprocessor
MIN_CHUNK = 1024  # ... but keep every chunk at least two loop steps long
PREFER_MAX_BYTES = 40_000_000
PREFER_ALL = False  # benchmark-only override (gpu_quant.py --gemv-all): take every product that fits


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, N, K, CHUNK,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False):
    # x: [K]; w: [N, K] row-major; out: [N]; part: [SPLIT, N] float32 partials; count: one zero per row tile
    pdl_enter(PDL)
    tile = tl.program_id(0)
    s = tl.program_id(1)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_live = rows < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    lo = s * CHUNK
    hi = tl.minimum(lo + CHUNK, K)
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + ks
        k_live = k < hi
        xv = tl.load(x_ptr + k, mask=k_live, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + k[None, :], mask=row_live[:, None] & k_live[None, :],
                    other=0.0).to(tl.float32)
        acc += w * xv[None, :]
    total = tl.sum(acc, 1)  # [BLOCK_N]
    if SPLIT == 1:
        tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=row_live)
    else:
        tl.store(part_ptr + s * N + rows, total, mask=row_live)
        tl.debug_barrier()  # every thread's partials are written before the release below
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") + 1
        if done == SPLIT:
            summed = tl.zeros([BLOCK_N], dtype=tl.float32)
            for sp in tl.static_range(SPLIT):  # the K chunks in order: deterministic
                summed += tl.load(part_ptr + sp * N + rows, mask=row_live, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + rows, summed.to(out_ptr.dtype.element_ty), mask=row_live)
            tl.store(count_ptr + tile, 0)  # ready for the next launch (or graph replay)


def split_of(n: int, k: int, device: torch.device) -> tuple[int, int]:
    """(K chunk, chunks) for an [n, k] weight: enough programs to fill the device, chunks of whole BLOCK_K steps."""
    tiles = triton.cdiv(n, BLOCK_N)
    want = triton.cdiv(PROGRAMS_PER_SM * multiprocessors(device), tiles)
    split = max(1, min(want, k // MIN_CHUNK, 8))
    chunk = triton.cdiv(triton.cdiv(k, split), BLOCK_K) * BLOCK_K
    return chunk, triton.cdiv(k, chunk)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes this product: one row, bf16 or float32 on both sides, a contiguous weight."""
    return (x.numel() == x.shape[-1] and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float32)
            and weight.dim() == 2 and weight.is_contiguous() and triton.cdiv(weight.shape[0], BLOCK_N) <= COUNTERS)


def prefer(weight: torch.Tensor) -> bool:
    """Whether this kernel beat cuBLAS on such a weight (K >= N, at most PREFER_MAX_BYTES; see the module doc)."""
    n, k = weight.shape
    return PREFER_ALL or k >= n and weight.numel() * weight.element_size() <= PREFER_MAX_BYTES


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` for one row x [..., K] (every leading dim 1): [..., N] in x.dtype."""
    n, k = weight.shape
    row = x.reshape(k)
    if not row.is_contiguous():
        row = row.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    chunk, split = split_of(n, k, x.device)
    part = torch.empty(split, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _gemv_kernel[(triton.cdiv(n, BLOCK_N), split)](
        row, weight, out, part, arrival_counters(x.device), n, k, chunk,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT=split, num_warps=4, **pdl(x.device),
    )
    return out
