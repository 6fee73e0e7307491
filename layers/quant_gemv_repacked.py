"""Split-K GEMV over repacked GGUF weights (layers/quant_repack.py): decode and verify windows (issue 20, item 2).

Same contract as quant_gemv.gemv (x [M, K] times W^T for M <= GEMV_MAX_ROWS, bias, column-slice
outputs, deterministic split-K, no host sync, CUDA-graph capturable), over the repacked rows. The
float32 partials of a row tile's SPLIT programs are summed in a fixed order by the last of them to
arrive (an acquire-release counter per tile, left at zero; up to FUSED_MAX_ROWS rows), so a GEMV is
one launch, not two (an 8B decode step has 144 GEMVs); more rows use quant_gemv's reduce kernel.

A program owns BLOCK_N output features and a range of the row's 16-byte units; one loop step
loads a [BLOCK_N, U, 4] int32 tile, so each thread issues one 16-byte load per row it holds
(several rows per thread: R = BLOCK_N over the rows one layout repetition covers), and the tile
is BLOCK_N * U * 16 bytes in flight. The one-row path keeps every tensor in that tile's shape,
so Triton converts no layout inside the loop (no shared memory, no barriers).

Dequantization per weight is one AND/OR and one float subtract: a field of a word, masked in
place at bit P and OR-ed under the exponent of 2^(23 - P), is the float 2^(23 - P) + c exactly
(fields above bit 22 are first shifted down once per word), so no shift and no int -> float
conversion per weight. The scale s and offset o of a unit's group are formed once per (row,
unit) in float32.

- One row (DOT_MIN_ROWS - 1), multiply-adds in factored form: per group, t = sum_k x_k c_k in
  per-lane float32 sums, then s * t + o * sum_k x_k; the activations' conversion and group sums
  are amortized over the R rows a thread holds. One multiply-add per weight and row.
- From DOT_MIN_ROWS rows, w = c * s + o (gguf's value, exact) per field plane, rounded to the
  activation dtype as a model dequantized at load holds it (float32: IEEE float32 products), and
  one tensor-core tl.dot per plane with K = 4 U; up to SWAP_MAX_ROWS rows the weight tile is the
  dot's A operand (out^T = W x^T: its conversion to the MMA layout is the cheaper one).

`plan` picks (BLOCK_N, U, warps, SPLIT) by rows and shape; the tiles are reasoned for sm_90 and
checked by the compile test (registers, no spills, no I2F); benchmarks/gpu_quant.py sweeps them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from draftflow.layers.quant_gemv import REDUCE_BLOCK, _reduce_kernel
from draftflow.layers.quant_kernels import _INTERPRETED, _f32, matmul_with
from draftflow.layers.quant_repack import RTYPES, SPEC, row_bytes, sections
from draftflow.layers.triton_kernels import COUNTERS, round_like, arrival_counters, multiprocessors, pdl, pdl_enter

DOT_MIN_ROWS = 2  # the multiply-add path is written for one row
_CODE = {name: i for i, name in enumerate(RTYPES)}  # Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K
RESIDENT = {"fma": 5, "dot": 4}  # programs of 4 warps resident on an SM: 96 registers (one row), 114-127 (dots)
PARTIAL_SHARE = 0.25
MAX_SPLIT = 32
MAGIC = 0x4B000000  # the bits of 2^23 as a float32 (see _plane)
PREFETCH = False  # one row: load step i + 1's tile while step i computes (sm_90 Q4_K: 128 registers, +0.4 instructions
# a weight; Q8_0 / Q6_K: 96 / 80 registers): off until the H200 sweep (benchmarks/gpu_quant.py) says otherwise
STAGES = 1  # loop steps in flight (tl.range's pipelining of the code loads; 1: none; more measured slower on the H200)
FUSED_REDUCE = True  # split-K partials summed by each tile's last-arriving program (one launch); False: _reduce_kernel


class Plan(NamedTuple):
    block_n: int  # output features per program
    units: int  # 16-byte units of a row per loop step (U)
    warps: int
    split: int  # ranges of the row (SPLIT)


# (BLOCK_N, U, warps) by path, from the sm_90 compile (tests/layers/test_quant_repacked_compile.py). One row: 4 warps
# cover 16 rows of 8 units, so BLOCK_N 64 gives each thread 4 rows (the activations' conversion and group sums
# amortized 4x) and 4 x 16 B of loads; a step is 8 KB; 96 registers, ~4.6 instructions a Q4_K weight (8 rows a
# thread: 4.2, but 168 registers). bf16 tl.dot
# up to 32 rows: the weight tile is the dot's A operand (out^T = W x^T; ~6.3-6.5 instructions a weight, <= 126
# registers with the fused reduction); more rows: x is A and a second kernel sums the partials (127 registers;
# fused: 152); float32 activations (IEEE products on CUDA cores, tests): 16 x 4 units, 8 warps.
TILES = {"fma": (64, 8, 4), "dot": (64, 8, 4), "dot_wide": (64, 8, 4), "dot_fp32": (16, 4, 8)}
SWAP_MAX_ROWS = 32  # bf16 tl.dot with the weight as the A operand up to this many rows
FUSED_MAX_ROWS = 32  # the last-arriver reduction up to this many rows


def tile(m: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, U, warps) for m rows of `dtype` activations."""
    if m < DOT_MIN_ROWS:
        return TILES["fma"]
    if dtype == torch.float32:
        return TILES["dot_fp32"]
    return TILES["dot_wide" if m > SWAP_MAX_ROWS else "dot"]


def steps_of(n_units: int, units: int, split: int) -> tuple[int, int]:
    """(units per range, ranges): ranges of whole U-unit steps covering the row's units, none empty."""
    steps = triton.cdiv(n_units, units)
    per = triton.cdiv(steps, max(1, min(split, steps))) * units
    return per, triton.cdiv(n_units, per)


def plan(m: int, n: int, qtype: str, k: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Plan:
    """Tiles and split-K for an [m, k] x [n, k]^T product of repacked `qtype` rows."""
    block_n, units, warps = tile(m, dtype)
    if _INTERPRETED:  # the interpreter pays per program: wide tiles, and a split of 2 so the tests cover it
        return Plan(256, units, warps, 2)
    sms = multiprocessors(device)
    cap = max(1, int(PARTIAL_SHARE * row_bytes(qtype, k) / (8 * m)))
    steps = triton.cdiv(k * SPEC[qtype][0] // 128, units)  # loop steps of a row
    slots = RESIDENT["fma" if m < DOT_MIN_ROWS else "dot"] * sms
    return Plan(block_n, units, warps, split_for(triton.cdiv(n, block_n), steps, slots, min(cap, MAX_SPLIT)))


def split_for(tiles: int, steps: int, slots: int, most: int) -> int:
    """Ranges of a row's `steps` loop steps (at most `most`) for tiles * ranges programs on `slots` resident ones: at
    least ~2 waves (robust to a residency other than RESIDENT) with the least idle tail (programs over whole waves'
    slots), the fewest ranges among those within 5% of the best; the most ranges if 2 waves cannot be had."""
    options = [r for r in sorted({triton.cdiv(steps, per) for per in range(1, steps + 1)}) if r <= most] or [1]
    full = {r: tiles * r / slots / math.ceil(tiles * r / slots) for r in options if tiles * r >= 1.9 * slots}
    if not full:
        return options[-1]
    best = max(full.values())
    return min(r for r, efficiency in full.items() if efficiency >= best - 0.05)


@triton.jit
def _plane(words, high, magic, J: tl.constexpr, BITS: tl.constexpr):
    # Field J of every word as float32 codes, exactly, with one AND/OR and one subtract: a field left in place at bit
    # P (masked; fields above bit 22 come from `high`, the words shifted down once by 12 or 16 bits) and OR-ed under
    # the exponent of 2^(23 - P) is the float 2^(23 - P) + c. `magic` (2^23's bits, 0x4B000000) is a run-time
    # argument so the compiler keeps the exponents in registers and each AND/OR is one LOP3 with the mask as its
    # immediate (two constants would cost a MOV per field).
    if BITS == 4:
        P: tl.constexpr = 4 * J if J < 5 else 4 * J - 12
        src = words if J < 5 else high
        v = src & (15 << P)
    else:
        P: tl.constexpr = 8 * J if J < 2 else 8 * J - 16
        src = words if J < 2 else high
        v = src & (255 << P)
    return (v | (magic - (P << 23))).to(tl.float32, bitcast=True) - (1 << (23 - P)) * 1.0


@triton.jit
def _halves(word):
    # a 4-byte word holding two little-endian float16 values -> (low, high) as float32
    low = (word & 65535).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _group_scales(w_ptr, b8_ptr, h_ptr, rowb, units, goff, soff, live, QTYPE: tl.constexpr, PAIRED: tl.constexpr):
    # rowb: [BN, 1] byte offset of each row; units: [1, U]; -> (s, o) [BN, U] float32 of each unit's group
    # (QTYPE: quant_repack.RTYPES order; 4-bit types have one group a unit, 8-bit ones half a group, Q6_K one)
    hrow = rowb // 2
    if QTYPE == 0 or QTYPE == 3:  # Q8_0, Q5_0: d per 32 weights = 2 units
        s = tl.load(h_ptr + (hrow + goff // 2) + units // 2, mask=live, other=0.0).to(tl.float32)
        o = s * (-128.0 if QTYPE == 0 else -16.0)
    elif QTYPE == 1:  # Q4_0
        s = tl.load(h_ptr + (hrow + goff // 2) + units, mask=live, other=0.0).to(tl.float32)
        o = s * -8.0
    elif QTYPE == 2 or QTYPE == 4:  # Q4_1 (a unit a group), Q5_1 (2 units a group): d, m (one 4-byte load)
        g = units if QTYPE == 2 else units // 2
        if PAIRED:
            s, o = _halves(tl.load(w_ptr + (rowb // 4 + goff // 4) + g, mask=live, other=0))
        else:
            s = tl.load(h_ptr + (hrow + goff // 2) + 2 * g, mask=live, other=0.0).to(tl.float32)
            o = tl.load(h_ptr + (hrow + goff // 2) + 2 * g + 1, mask=live, other=0.0).to(tl.float32)
    elif QTYPE == 5 or QTYPE == 6:  # Q4_K (8 units a super-block), Q5_K (16): sc, m bytes; d, dmin per 256
        g = units if QTYPE == 5 else units // 2
        if PAIRED:  # two loads, not four: (sc, m) as one 2-byte load, (d, dmin) as one 4-byte load
            pair = tl.load(h_ptr + (hrow + goff // 2) + g, mask=live, other=0.0).to(tl.int16, bitcast=True)
            pair = pair.to(tl.int32)
            d, dmin = _halves(tl.load(w_ptr + (rowb // 4 + soff // 4) + g // 8, mask=live, other=0))
            sc = _f32(pair & 255)
            mn = _f32((pair >> 8) & 255)
        else:
            sup = g // 8
            sc = _f32(tl.load(b8_ptr + (rowb + goff) + 2 * g, mask=live, other=0).to(tl.int32))
            mn = _f32(tl.load(b8_ptr + (rowb + goff) + 2 * g + 1, mask=live, other=0).to(tl.int32))
            d = tl.load(h_ptr + (hrow + soff // 2) + 2 * sup, mask=live, other=0.0).to(tl.float32)
            dmin = tl.load(h_ptr + (hrow + soff // 2) + 2 * sup + 1, mask=live, other=0.0).to(tl.float32)
        s = d * sc
        o = -(dmin * mn)
    else:  # Q6_K: int8 sc per 16 weights = 1 unit, d per 256
        sc = _f32(((tl.load(b8_ptr + (rowb + goff) + units, mask=live, other=0).to(tl.int32)) ^ 128) - 128)
        d = tl.load(h_ptr + (hrow + soff // 2) + units // 16, mask=live, other=0.0).to(tl.float32)
        s = d * sc
        o = s * -32.0
    return s, o


@triton.jit
def _widen(x):
    # bfloat16 -> float32 as one shift of the bits (Triton's conversion takes two instructions for every other element)
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _step(w_ptr, wrow, b8_ptr, h_ptr, rowb, units, live_u, goff, soff, QTYPE: tl.constexpr,
          PAIRED: tl.constexpr = False):
    # one loop step's weights: words [BN, U, 4] int32 (one 16-byte load per row and thread) and (s, o) [BN, U];
    # PAIRED: a group's scale fields in fewer, wider loads (the windows' tl.dot path; the one-row paths measured
    # slower with it, docs/GGUF.md 2026-12-05)
    wi = tl.arange(0, 4)
    words = tl.load(wrow + (units[None, :, None] * 4 + wi[None, None, :]), mask=live_u[None, :, None], other=0)
    s, o = _group_scales(w_ptr, b8_ptr, h_ptr, rowb, units[None, :], goff, soff, live_u[None, :], QTYPE, PAIRED)
    return words, s, o


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b8_ptr, h_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, row_words, goff, soff, n_units,
    per_split, stride_xm, stride_om, magic,
    QTYPE: tl.constexpr, BITS: tl.constexpr, U: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr, IEEE: tl.constexpr, NATIVE: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr,
    OUT_BF16: tl.constexpr, EVEN: tl.constexpr, SWAP: tl.constexpr, FUSED: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr = False, STAGES: tl.constexpr = 1,
):
    # x: [M, K]; w / b8 / h: the repacked rows as int32 / uint8 / float16 (one tensor); program (i, r): features
    # i*BLOCK_N.. over units r*per_split.. (whole U-unit steps). Rows past N read row N-1 and are not stored.
    # DIRECT (SPLIT 1): bias, round, store into out [M, N]; else float32 partials into part [SPLIT, M, N], summed
    # by the tile's last-arriving program (FUSED: its count_ptr counter, left at zero) or by _reduce_kernel.
    pdl_enter(PDL)
    GW: tl.constexpr = 128 // BITS  # weights per unit
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, N - 1)
    rw = safe.to(tl.int64) * row_words  # [BN] the row's first word
    wrow = w_ptr + rw[:, None, None]
    rowb = (rw * 4)[:, None]
    ms = tl.arange(0, BLOCK_M)
    live_m = ms < M
    ui = tl.arange(0, U)
    wi = tl.arange(0, 4)
    first = tl.program_id(1) * per_split
    last = tl.minimum(first + per_split, n_units)
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        c = tl.arange(0, 4 * U)  # the dot's K index: unit c // 4, word c % 4
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc3 = tl.zeros([BLOCK_N, U], dtype=tl.float32)
    if PREFETCH:
        words_n, s_n, o_n = _step(w_ptr, wrow, b8_ptr, h_ptr, rowb, first + ui, (first + ui) < last, goff, soff,
                                  QTYPE, USE_DOT)
    for u0 in tl.range(first, last, U, num_stages=STAGES):
        units = u0 + ui  # [U]
        live_u = (units < last) | EVEN
        if PREFETCH:  # this step's tile was loaded during the previous step; load the next one now
            words, s, o = words_n, s_n, o_n
            words_n, s_n, o_n = _step(w_ptr, wrow, b8_ptr, h_ptr, rowb, units + U, (units + U) < last, goff, soff,
                                      QTYPE, USE_DOT)
        else:
            # [BN, U, 4], [BN, U]
            words, s, o = _step(w_ptr, wrow, b8_ptr, h_ptr, rowb, units, live_u, goff, soff, QTYPE, USE_DOT)
        high = words >> (12 if BITS == 4 else 16)
        if USE_DOT:
            live_c = ((u0 + c // 4) < last) | EVEN
            live_x = live_m[:, None] & live_c[None, :]
            for j in tl.static_range(32 // BITS):
                q = _plane(words, high, magic, j, BITS)
                w = tl.reshape(q * s[:, :, None] + o[:, :, None], [BLOCK_N, 4 * U])  # gguf's values
                xoff = (u0 + c // 4) * GW + 4 * j + c % 4
                x = tl.load(x_ptr + ms[:, None] * stride_xm + xoff[None, :], mask=live_x, other=0.0)  # [BM, 4U]
                if IEEE:  # float32 activations: IEEE float32 products, as a float32 model's matmul
                    acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                elif SWAP:  # out^T = W x^T, the weight rounded as a dequantized 16-bit model holds it
                    if NATIVE:
                        acc_t += tl.dot(w.to(x.dtype), tl.trans(x))
                    else:  # (interpreter) the same products in float32
                        acc_t += tl.dot(round_like(w, True), tl.trans(x.to(tl.float32)), input_precision="ieee")
                elif NATIVE:
                    acc += tl.dot(x, tl.trans(w.to(x.dtype)))
                else:
                    acc += tl.dot(x.to(tl.float32), tl.trans(round_like(w, True)), input_precision="ieee")
        else:  # one row: everything in the weight tile's [BN, U, 4] shape, so no layout conversion
            t = tl.zeros([BLOCK_N, U, 4], dtype=tl.float32)
            xs = tl.zeros([U, 4], dtype=tl.float32)  # per lane: summed over the lanes once, after the loop
            for j in tl.static_range(32 // BITS):
                q = _plane(words, high, magic, j, BITS)  # [BN, U, 4]
                xoff = units[:, None] * GW + 4 * j + wi[None, :]  # [U, 4]: 4 consecutive weights
                x = _widen(tl.load(x_ptr + xoff, mask=live_u[:, None], other=0.0))  # [U, 4] float32
                xs += x
                t += x[None, :, :] * q
            acc3 += tl.sum(t, axis=2) * s + o * tl.sum(xs, axis=1)[None, :]
    if not USE_DOT:
        acc = tl.sum(acc3, axis=1)[None, :]  # [1, BN]
    elif SWAP:
        acc += tl.trans(acc_t)
    store = live_m[:, None] & (rows[None, :] < N)
    if not DIRECT:
        tl.store(part_ptr + (tl.program_id(1) * M + ms[:, None]) * N + rows[None, :], acc, mask=store)
    if FUSED:  # the last of the tile's programs to arrive sums the partials, in order
        split = tl.num_programs(1)
        tl.debug_barrier()  # every thread's partials are written before the release below
        done = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel") + 1
        store = store & ((rows[None, :] * 0 + done) == split)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for sp in range(0, split):  # fixed order: deterministic
            acc += tl.load(part_ptr + (sp * M + ms[:, None]) * N + rows[None, :], mask=store, other=0.0,
                           cache_modifier=".cg")
        if done == split:
            tl.store(count_ptr + tl.program_id(0), 0)  # ready for the next launch (or graph replay)
    if DIRECT or FUSED:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + safe).to(tl.float32)[None, :]
        acc = round_like(acc, OUT_BF16)
        tl.store(out_ptr + ms[:, None] * stride_om + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=store)


@triton.jit
def _dequant_kernel(w_ptr, b8_ptr, h_ptr, out_ptr, N, K, row_words, goff, soff, n_units, magic,
                    QTYPE: tl.constexpr, BITS: tl.constexpr, U: tl.constexpr, BLOCK_N: tl.constexpr,
                    OUT_BF16: tl.constexpr):
    # repacked rows -> out [N, K] in out's dtype; one program per (BLOCK_N rows, U units)
    GW: tl.constexpr = 128 // BITS
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, N - 1)
    rw = safe.to(tl.int64) * row_words
    units = tl.program_id(1) * U + tl.arange(0, U)
    wi = tl.arange(0, 4)
    live_u = units < n_units
    words = tl.load(w_ptr + rw[:, None, None] + (units[None, :, None] * 4 + wi[None, None, :]),
                    mask=live_u[None, :, None], other=0)
    s, o = _group_scales(w_ptr, b8_ptr, h_ptr, (rw * 4)[:, None], units[None, :], goff, soff, live_u[None, :],
                         QTYPE, False)
    high = words >> (12 if BITS == 4 else 16)
    live = (rows[:, None, None] < N) & live_u[None, :, None]
    orow = out_ptr + safe.to(tl.int64)[:, None, None] * K
    for j in tl.static_range(32 // BITS):
        q = _plane(words, high, magic, j, BITS)
        w = round_like(q * s[:, :, None] + o[:, :, None], OUT_BF16)
        tl.store(orow + (units[None, :, None] * GW + 4 * j + wi[None, None, :]), w.to(out_ptr.dtype.element_ty),
                 mask=live)


def _views(packed: torch.Tensor, qtype: str, k: int) -> tuple:
    if qtype not in SPEC:
        raise ValueError(f"no repacked kernel for {qtype}; expected one of {', '.join(RTYPES)}")
    _, goff, soff, rb = sections(qtype, k)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != rb or packed.stride(1) != 1 \
            or packed.stride(0) != rb:
        raise ValueError(f"repacked {qtype} rows {tuple(packed.shape)} ({packed.dtype}) are not rows of {k} weights; "
                         f"expected [N, {rb}] uint8, contiguous")
    return packed.view(torch.int32), packed, packed.view(torch.float16), rb // 4, goff, soff, k * SPEC[qtype][0] // 128


def gemv(
    x: torch.Tensor,  # [M, K], unit column stride
    packed: torch.Tensor,  # [N, row_bytes(qtype, K)] uint8
    qtype: str,
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [M, N], unit column stride (a column slice of a wider output is fine)
    block_n: int | None = None,  # None: `plan` (as units, num_warps, split_k)
    units: int | None = None,
    num_warps: int | None = None,
    split_k: int | None = None,
    fused_reduce: bool | None = None,  # None: FUSED_REDUCE
    prefetch: bool | None = None,  # None: PREFETCH (one row)
    stages: int | None = None,  # None: STAGES
) -> torch.Tensor:  # [M, N] in x.dtype
    """x @ W^T reading every repacked weight byte once for all M rows (M <= GEMV_MAX_ROWS)."""
    m, k = x.shape
    if m == 1 and (block_n, units, num_warps, split_k, fused_reduce, prefetch, stages) == (None,) * 7 \
            and quant_gemv_rows.fits(x, packed, qtype, out):
        return quant_gemv_rows.gemv(x, packed, qtype, bias, out)
    w32, w8, w16, row_words, goff, soff, n_units = _views(packed, qtype, k)
    n = packed.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    use_dot = m >= DOT_MIN_ROWS
    p = plan(m, n, qtype, k, x.device, x.dtype)
    block_n, units, warps, split = block_n or p.block_n, units or p.units, num_warps or p.warps, split_k or p.split
    per, split = steps_of(n_units, units, split)
    block_m = max(16, triton.next_power_of_2(m)) if use_dot else triton.next_power_of_2(m)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    common = dict(HAS_BIAS=bias is not None, OUT_BF16=out.dtype == torch.bfloat16)
    tiles = triton.cdiv(n, block_n)
    fused = split > 1 and (FUSED_REDUCE if fused_reduce is None else fused_reduce) and tiles <= COUNTERS \
        and m <= FUSED_MAX_ROWS
    count = arrival_counters(x.device) if fused else part
    _gemv_kernel[(tiles, split)](
        x, w32, w8, w16, bias if bias is not None else x, out, part, count, m, n, row_words, goff, soff, n_units, per,
        x.stride(0), out.stride(0), MAGIC, QTYPE=_CODE[qtype], BITS=SPEC[qtype][0], U=units, BLOCK_M=block_m,
        BLOCK_N=block_n, USE_DOT=use_dot, IEEE=x.dtype == torch.float32, NATIVE=not _INTERPRETED,
        DIRECT=split == 1, EVEN=n_units % units == 0, SWAP=m <= SWAP_MAX_ROWS and x.dtype != torch.float32,
        FUSED=fused, PREFETCH=not use_dot and (PREFETCH if prefetch is None else prefetch), STAGES=stages or STAGES,
        **common,
        num_warps=warps, **pdl(x.device),
    )
    if split > 1 and not fused:
        _reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK), m)](
            part, bias if bias is not None else part, out, m, n, out.stride(0), SPLIT=split, BLOCK=REDUCE_BLOCK,
            **common, num_warps=4,
        )
    return out


def dequantize(packed: torch.Tensor, qtype: str, k: int, dtype: torch.dtype,
               block_n: int = 32 if not _INTERPRETED else 256) -> torch.Tensor:  # [N, K]
    """The weight of repacked rows as an [N, k] tensor of `dtype` (gguf's values, then rounded once)."""
    w32, w8, w16, row_words, goff, soff, n_units = _views(packed, qtype, k)
    n, units = packed.shape[0], 8
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(n_units, units))](
        w32, w8, w16, out, n, k, row_words, goff, soff, n_units, MAGIC, QTYPE=_CODE[qtype], BITS=SPEC[qtype][0],
        U=units,
        BLOCK_N=block_n, OUT_BF16=dtype == torch.bfloat16, num_warps=4,
    )
    return out


def repacked_matmul(
    x: torch.Tensor,  # [..., K]
    packed: torch.Tensor,  # [N, row_bytes(qtype, K)] uint8
    qtype: str,
    in_features: int,
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [rows of x, N] view to write into (unit column stride)
) -> torch.Tensor:  # [..., N] in x.dtype (`out` itself when given)
    """x @ W^T (+ bias) for repacked W: the GEMV up to GEMV_MAX_ROWS rows, else dequantize + torch.matmul."""
    return matmul_with(gemv, dequantize, x, packed, qtype, in_features, bias, out)


from draftflow.layers import quant_gemv_rows  # noqa: E402  (one-row products; it imports this module's pieces)
