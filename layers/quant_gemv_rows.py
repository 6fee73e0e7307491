"""One-row GEMV over repacked GGUF weights with the activations held in registers (issue 20, item 2).

The split-K GEMV of quant_gemv_repacked walks a program's rows' K range: each loop step loads a
new slice of x for every plane (8 loads a step at 4 bits) and a scale group per (row, unit) as
four scattered small loads. On the H200 `ncu` put that kernel at 80% of the L1's throughput and
23% of DRAM's (Q4_K, 24576 x 4096, 1.12 TB/s; benchmarks/results/h200_ncu_repacked_gemv.txt): the
L1 requests, not the instructions or the bytes, bound it.

Here the roles swap. A program owns a chunk of U consecutive 16-byte units of every row (U * GW
weights of K) and a range of ROWS rows; it loads that chunk's activations once, as one [U, 4]
float32 tensor per bit plane (each lane keeps its own unit's 32 or 16 values), and then walks
its rows BLOCK_N at a time. A warp covers one row's U = 32 units per layout repetition, so the
codes arrive as whole 512-byte row segments and a row's scale fields for the chunk are one
contiguous run; no activation is loaded inside the loop. Each step ends with a sum over the
lanes (one per unit) and stores BLOCK_N float32 partials; the chunks of a row range are summed in
chunk order by the range's last program to arrive (an acquire-release counter per range, left at
zero; deterministic), which adds the bias, rounds once and stores.

Arithmetic per weight is the split-K kernel's (`_plane`: one AND/OR and one subtract per code,
then a multiply-add with the activation; per (row, unit) s * t + o * sum(x)), so results agree
with it to float32 rounding, and gguf's dequantized values are what is multiplied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftflow.layers.quant_gemv_repacked import MAGIC, _CODE, _plane, _step, _views, _widen
from draftflow.layers.quant_kernels import _INTERPRETED
from draftflow.layers.quant_repack import SPEC
from draftflow.layers.triton_kernels import COUNTERS, round_like, arrival_counters, multiprocessors, pdl, pdl_enter

ON = True  # `quant_gemv_repacked.gemv` sends one-row products of QTYPES here (benchmarks/gpu_quant.py times both)
# The types of 8-bit codes (Q8_0, Q6_K, Q5_*) and Q4_K, where the H200 measured this kernel faster (docs/GGUF.md;
# Q4_K at 8 rows a step: gate/up 44.1 against 52.8 us, down 23.1 against 29.2). The other 4-bit types stay on the
# split-K kernel: not measured here
QTYPES = frozenset(t for t, spec in SPEC.items() if spec[0] == 8) | {"Q4_K"}
UNITS = 32  # units per chunk: one warp's lanes, one unit each
# rows per loop step by bits per code: 4 warps x 2 or 4 layout repetitions (2 or 4 x 16 B of codes in flight per
# lane). With Triton 3.6 (the H200 image) 16 rows of 4-bit codes take 215 registers (2 programs an SM; 3.9: 72), 8
# rows 117; 8-bit codes 128 at 16 rows (compiled for sm_90 with each Triton; the compile test checks the installed one)
BLOCK_N = {4: 8, 8: 16}
WARPS = 4
# loop steps in flight (tl.range's software pipelining: the codes arrive by cp.async into shared memory); 1: none. By
# bits per code. On the H200 (Triton 3.6) every value above 1 measured slower (docs/GGUF.md, 2026-12-04)
STAGES = {4: 1, 8: 1}
# 16-bit activations: the codes' products as integer dot products (dp4a, 4 multiply-adds an instruction) with the
# activations quantized per unit in the kernel, as INT8_TERMS int8 terms (llama.cpp's MMVQ uses one; two keep the
# activations to 2^-16 of the unit's largest, finer than their own bf16 rounding); 0: float multiply-adds. One H100,
# whole Qwen3-8B-shaped decode step (benchmarks/gpu_quant.py --int8, docs/GGUF.md 2026-12-05): Q4_K_M 4.92 -> 4.49-4.55
# ms, Q8_0 5.82 -> 5.58. Q6_K measured slower with it then (6.35 -> 6.58 ms); with the prefetch below (since 2026-12-06)
# it is faster: 6.302 / 6.303 -> 6.095 / 6.095 ms, order A B A B on one H100 (docs/GGUF.md, 2026-12-07)
INT8_TERMS = 2
INT8_QTYPES = QTYPES
# Rows a loop step with int8 activations, and a register cap for ptxas (None: none), by bits per code. One H100,
# Triton 3.6, Q4_K gate/up 24576 x 4096 (benchmarks/results/h100_q4k_rows_sweep.log): 16 rows uncapped took 127
# registers, 23% occupancy (ncu: stalls on loads' scoreboards) and 38.1 us; 8 rows capped at 80 34.3 us (down 12288:
# 19.5 against 20.2 us). The Qwen3-8B-shaped Q4_K_M step went 4.467 -> 4.219-4.220 ms, twice (docs/GGUF.md)
INT8_BLOCK_N = {4: 8, 8: 16}
INT8_MAXNREG = {4: 96, 8: None}
# With int8 activations each loop step loads the next step's codes and scales before it computes its own (one more
# step's bytes in flight a warp; 8-24 more registers a thread with Triton 3.9), by bits per code; the cap above rose to
# 96 for it. One H100, Triton 3.6, CUDA graphs of 20 calls (benchmarks/results/h100_rows_prefetch_sweep.log): Q4_K
# gate/up 24576 x 4096 34.7 -> 32.4 us, down 4096 x 12288 20.2 -> 18.7 us; Q8_0 gate/up 62.9 -> 54.9 us. The float
# path (Q6_K then) measured slower with it (down 44.2 -> 46.8 us) and keeps one load per step (float32 activations)
INT8_PREFETCH = {4: True, 8: True}
PROGRAMS_PER_SM = 6  # row ranges shrink (down to 16 rows) until the grid has this many programs per multiprocessor


def rows_per_program(n: int, chunks: int, sms: int) -> int:
    """Rows of a program: the most (a multiple of 16, at most 256) that still gives PROGRAMS_PER_SM * sms programs
    over `chunks` K chunks; 16 if even that falls short."""
    rows = 256
    while rows > 16 and triton.cdiv(n, rows) * chunks < PROGRAMS_PER_SM * sms:
        rows //= 2
    return rows


LOW = tl.constexpr(254)  # a second int8 term's weight: x ~ dx * (q1 + q2 / LOW), |q2| <= 127


@triton.jit
def _int8(y):
    # float32 y, |y| <= 127 (up to rounding) -> the nearest integer in [-127, 127] as int32
    return tl.minimum(tl.maximum(tl.floor(y + 0.5), -127.0), 127.0).to(tl.int32)


@triton.jit
def _int8_pack(y0, y1, y2, y3, TERMS: tl.constexpr):
    # four [U, 4] float32 tensors scaled to [-127, 127] -> (q1, q2): int32 words of 4 int8 bytes (byte b from y_b);
    # q1 the nearest integers, q2 (TERMS 2) the remainders y - q1 in units of 1 / LOW
    a0, a1, a2, a3 = _int8(y0), _int8(y1), _int8(y2), _int8(y3)
    q1 = (a0 & 255) | ((a1 & 255) << 8) | ((a2 & 255) << 16) | ((a3 & 255) << 24)
    q2 = q1
    if TERMS == 2:
        b0, b1 = _int8((y0 - a0) * LOW), _int8((y1 - a1) * LOW)
        b2, b3 = _int8((y2 - a2) * LOW), _int8((y3 - a3) * LOW)
        q2 = (b0 & 255) | ((b1 & 255) << 8) | ((b2 & 255) << 16) | ((b3 & 255) << 24)
    return q1, q2


@triton.jit
def _dp4a(codes, acts, acc, NATIVE: tl.constexpr):
    # acc + the 4 bytes of `codes` (unsigned) times the 4 bytes of `acts` (signed), summed: one dp4a on the GPU
    if NATIVE:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [codes, tl.broadcast_to(acts, codes.shape), acc + tl.zeros_like(codes)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    total = acc + tl.zeros_like(codes)
    for b in tl.static_range(4):  # (the interpreter) the same sum, byte by byte
        total += ((codes >> (8 * b)) & 255) * ((((acts >> (8 * b)) & 255) ^ 128) - 128)
    return total


@triton.jit
def _row_block(words, s, o, rows, last, ui, c, N, x0, x1, x2, x3, x4, x5, x6, x7, xa_lo, xa_hi, xb_lo, xb_hi, dx, xsum,
               magic, bias_ptr, out_ptr, part_ptr, BITS: tl.constexpr, INT8: tl.constexpr, NATIVE: tl.constexpr,
               HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, DIRECT: tl.constexpr):
    # one loop step: rows' codes `words` [BN, U, 4] and scales s, o [BN, U] times the chunk's activations, summed over
    # the lanes; stored (DIRECT: with bias, rounded) or as the chunk's float32 partials
    if INT8 > 0:  # integer dot products of the codes with the int8 activations, 4 a dp4a
        lo = words
        if BITS == 4:  # the codes' low and high nibbles as bytes
            lo = words & 0x0F0F0F0F
            hi = (words >> 4) & 0x0F0F0F0F
        i1 = _dp4a(lo, xa_lo[None, :, :], 0, NATIVE)
        if BITS == 4:
            i1 = _dp4a(hi, xa_hi[None, :, :], i1, NATIVE)
        isum = tl.sum(i1, axis=2)
        if INT8 == 2:
            i2 = _dp4a(lo, xb_lo[None, :, :], 0, NATIVE)
            if BITS == 4:
                i2 = _dp4a(hi, xb_hi[None, :, :], i2, NATIVE)
            isum = isum * LOW + tl.sum(i2, axis=2)
        ts = isum.to(tl.float32) * dx[None, :]  # [BN, U]
    else:
        high = words >> (12 if BITS == 4 else 16)
        t = x0[None, :, :] * _plane(words, high, magic, 0, BITS)
        t += x1[None, :, :] * _plane(words, high, magic, 1, BITS)
        t += x2[None, :, :] * _plane(words, high, magic, 2, BITS)
        t += x3[None, :, :] * _plane(words, high, magic, 3, BITS)
        if BITS == 4:
            t += x4[None, :, :] * _plane(words, high, magic, 4, BITS)
            t += x5[None, :, :] * _plane(words, high, magic, 5, BITS)
            t += x6[None, :, :] * _plane(words, high, magic, 6, BITS)
            t += x7[None, :, :] * _plane(words, high, magic, 7, BITS)
        ts = tl.sum(t, axis=2)
    # [BN, U]: the row's sum over the lanes in every lane; lane 0 stores it (kept in the tile's layout: no trip
    # through shared memory)
    acc = tl.sum(ts * s + o * xsum[None, :], axis=1, keep_dims=True) + tl.zeros_like(s)
    at = rows[:, None] + ui[None, :] * 0
    live = (rows < last)[:, None] & (ui == 0)[None, :]
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + at, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, round_like(acc, OUT_BF16).to(out_ptr.dtype.element_ty), mask=live)
    else:
        tl.store(part_ptr + c * N + at, acc, mask=live)


@triton.jit
def _gemv_rows_kernel(
    x_ptr, w_ptr, b8_ptr, h_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, row_words, goff, soff, n_units, ROWS,
    magic,
    QTYPE: tl.constexpr, BITS: tl.constexpr, U: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    OUT_BF16: tl.constexpr, EVEN: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr = False,
    STAGES: tl.constexpr = 1, INT8: tl.constexpr = 0, NATIVE: tl.constexpr = True, PREFETCH: tl.constexpr = False,
):
    # x: [K]; w / b8 / h: the repacked rows (one tensor, three views); out: [N]; part: [chunks, N] float32; count:
    # one zero per row range. Program (g, c): rows g*ROWS .. over units c*U .. c*U + U - 1. DIRECT (one chunk):
    # bias, round and store from the loop.
    pdl_enter(PDL)
    GW: tl.constexpr = 128 // BITS  # weights per unit
    c = tl.program_id(1)
    ui = tl.arange(0, U)
    wi = tl.arange(0, 4)
    units = c * U + ui
    live_u = (units < n_units) | EVEN
    xo = units[:, None] * GW + wi[None, :]  # [U, 4]: field j of word i is weight GW*u + 4*j + i
    lx = live_u[:, None]
    x0 = _widen(tl.load(x_ptr + xo, mask=lx, other=0.0))
    x1 = _widen(tl.load(x_ptr + xo + 4, mask=lx, other=0.0))
    x2 = _widen(tl.load(x_ptr + xo + 8, mask=lx, other=0.0))
    x3 = _widen(tl.load(x_ptr + xo + 12, mask=lx, other=0.0))
    xs = x0 + x1 + x2 + x3
    x4, x5, x6, x7 = x0, x0, x0, x0  # (8-bit codes have four planes: placeholders for _row_block's unused arguments)
    if BITS == 4:
        x4 = _widen(tl.load(x_ptr + xo + 16, mask=lx, other=0.0))
        x5 = _widen(tl.load(x_ptr + xo + 20, mask=lx, other=0.0))
        x6 = _widen(tl.load(x_ptr + xo + 24, mask=lx, other=0.0))
        x7 = _widen(tl.load(x_ptr + xo + 28, mask=lx, other=0.0))
        xs += x4 + x5 + x6 + x7
    xsum = tl.sum(xs, axis=1)  # [U]: the unit's activations summed (the offset o's factor)
    xa_lo, xa_hi, xb_lo, xb_hi, dx = xo, xo, xo, xo, xsum  # (placeholders where a path does not use them)
    if INT8 > 0:  # the unit's activations as INT8 int8 terms, 4 to a word in the order of the codes' bytes
        amax = tl.maximum(tl.abs(x0), tl.abs(x1))
        amax = tl.maximum(amax, tl.maximum(tl.abs(x2), tl.abs(x3)))
        if BITS == 4:
            amax = tl.maximum(amax, tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
        amax = tl.max(amax, axis=1)  # [U]
        inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)[:, None]  # x * inv in [-127, 127]
        dx = amax / (127.0 if INT8 == 1 else 127.0 * LOW)  # [U]: the unit's step of an integer sum
        if BITS == 4:  # word i's low nibbles are fields 0, 2, 4, 6 (weights i, 8 + i, ...), its high ones 1, 3, 5, 7
            xa_lo, xb_lo = _int8_pack(x0 * inv, x2 * inv, x4 * inv, x6 * inv, INT8)
            xa_hi, xb_hi = _int8_pack(x1 * inv, x3 * inv, x5 * inv, x7 * inv, INT8)
        else:  # word i's bytes are fields 0..3
            xa_lo, xb_lo = _int8_pack(x0 * inv, x1 * inv, x2 * inv, x3 * inv, INT8)
    first = tl.program_id(0) * ROWS
    last = tl.minimum(first + ROWS, N)
    if PREFETCH:  # the first step's codes and scales here; each step then loads the next one's before it computes
        rw = tl.minimum(first + tl.arange(0, BLOCK_N), last - 1).to(tl.int64) * row_words
        next_words, next_s, next_o = _step(w_ptr, w_ptr + rw[:, None, None], b8_ptr, h_ptr, (rw * 4)[:, None], units,
                                           live_u, goff, soff, QTYPE)
        for r0 in tl.range(first, last, BLOCK_N, num_stages=STAGES):
            rows = r0 + tl.arange(0, BLOCK_N)
            words, s, o = next_words, next_s, next_o
            rw = tl.minimum(rows + BLOCK_N, last - 1).to(tl.int64) * row_words  # past the range: its last row again
            next_words, next_s, next_o = _step(w_ptr, w_ptr + rw[:, None, None], b8_ptr, h_ptr, (rw * 4)[:, None],
                                               units, live_u, goff, soff, QTYPE)
            _row_block(words, s, o, rows, last, ui, c, N, x0, x1, x2, x3, x4, x5, x6, x7, xa_lo, xa_hi, xb_lo, xb_hi,
                       dx, xsum, magic, bias_ptr, out_ptr, part_ptr, BITS, INT8, NATIVE, HAS_BIAS, OUT_BF16, DIRECT)
    else:
        for r0 in tl.range(first, last, BLOCK_N, num_stages=STAGES):
            rows = r0 + tl.arange(0, BLOCK_N)
            rw = tl.minimum(rows, N - 1).to(tl.int64) * row_words  # [BN] the row's first word
            words, s, o = _step(w_ptr, w_ptr + rw[:, None, None], b8_ptr, h_ptr, (rw * 4)[:, None], units, live_u,
                                goff, soff, QTYPE)  # [BN, U, 4], [BN, U]
            _row_block(words, s, o, rows, last, ui, c, N, x0, x1, x2, x3, x4, x5, x6, x7, xa_lo, xa_hi, xb_lo, xb_hi,
                       dx, xsum, magic, bias_ptr, out_ptr, part_ptr, BITS, INT8, NATIVE, HAS_BIAS, OUT_BF16, DIRECT)
    if not DIRECT:  # the range's last program to arrive sums its chunks in order
        chunks = tl.num_programs(1)
        tl.debug_barrier()  # every thread's partials are written before the release below
        done = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel") + 1
        if done == chunks:
            for r0 in range(first, last, BLOCK_N):
                rows = r0 + tl.arange(0, BLOCK_N)
                live = rows < last
                acc = tl.zeros([BLOCK_N], dtype=tl.float32)
                for cc in range(0, chunks):  # fixed order: deterministic
                    acc += tl.load(part_ptr + cc * N + rows, mask=live, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    acc += tl.load(bias_ptr + rows, mask=live, other=0.0).to(tl.float32)
                tl.store(out_ptr + rows, round_like(acc, OUT_BF16).to(out_ptr.dtype.element_ty), mask=live)
            tl.store(count_ptr + tl.program_id(0), 0)  # ready for the next launch (or graph replay)


def int8_terms(x: torch.Tensor, qtype: str) -> int:
    """The int8 terms the one-row product of `x` takes: INT8_TERMS for 16-bit activations of INT8_QTYPES, else 0
    (float32 activations keep exact float multiply-adds: the lossless tests' dtype)."""
    return INT8_TERMS if x.dtype in (torch.bfloat16, torch.float16) and qtype in INT8_QTYPES else 0


def fits(x: torch.Tensor, packed: torch.Tensor, qtype: str, out: torch.Tensor | None) -> bool:
    """Whether this kernel takes the product: ON and a type of QTYPES, one row, a contiguous output row, few enough
    row ranges."""
    return (ON and qtype in QTYPES and x.shape[0] == 1 and (out is None or out.stride(-1) == 1)
            and triton.cdiv(packed.shape[0], 16) <= COUNTERS)


def gemv(x: torch.Tensor, packed: torch.Tensor, qtype: str, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, rows: int | None = None, block_n: int | None = None,
         maxnreg: int | None = None, stages: int | None = None, int8: int | None = None,
         prefetch: bool | None = None) -> torch.Tensor:  # [1, N]
    """x [1, K] @ W^T (+ bias) for repacked rows `packed` [N, row bytes]; `rows` per program (None: by the grid),
    `block_n` rows a loop step (None: BLOCK_N, or INT8_BLOCK_N with int8, by bits), `maxnreg` a register cap for ptxas
    (None: INT8_MAXNREG with int8), `stages` loop steps in flight (None: STAGES by bits), `prefetch` whether a step
    loads the next step's codes before it computes (None: INT8_PREFETCH by bits with int8, else no) (benchmark
    sweeps); `int8` the activations' int8 terms (0: float multiply-adds; None: `int8_terms`). The result is in
    x.dtype."""
    int8 = int8_terms(x, qtype) if int8 is None else int8
    if int8 not in (0, 1, 2):
        raise ValueError(f"int8 terms must be 0, 1 or 2, not {int8}")
    k = x.shape[1]
    w32, w8, w16, row_words, goff, soff, n_units = _views(packed, qtype, k)
    n = packed.shape[0]
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    chunks = triton.cdiv(n_units, UNITS)
    block_n = block_n or (INT8_BLOCK_N if int8 else BLOCK_N)[SPEC[qtype][0]]
    maxnreg = maxnreg or (INT8_MAXNREG[SPEC[qtype][0]] if int8 else None)
    rows = rows or max(rows_per_program(n, chunks, multiprocessors(x.device)), block_n)
    if rows % block_n:
        raise ValueError(f"rows per program ({rows}) must be a multiple of the rows a step ({block_n})")
    direct = chunks == 1
    part = out if direct else torch.empty(chunks, n, dtype=torch.float32, device=x.device)
    _gemv_rows_kernel[(triton.cdiv(n, rows), chunks)](
        x, w32, w8, w16, bias if bias is not None else x, out, part, arrival_counters(x.device), n, row_words, goff,
        soff, n_units, rows, MAGIC, QTYPE=_CODE[qtype], BITS=SPEC[qtype][0], U=UNITS, BLOCK_N=block_n,
        HAS_BIAS=bias is not None, OUT_BF16=out.dtype == torch.bfloat16, EVEN=n_units % UNITS == 0, DIRECT=direct,
        STAGES=stages or STAGES[SPEC[qtype][0]], INT8=int8, NATIVE=not _INTERPRETED,
        PREFETCH=(int8 > 0 and INT8_PREFETCH[SPEC[qtype][0]]) if prefetch is None else prefetch, num_warps=WARPS,
        **pdl(x.device),
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    return out
