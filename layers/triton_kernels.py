"""One Triton kernel for the attention prologue of a static step: q/k-norm, RoPE and the KV write.

After the fused q/k/v product, eager PyTorch needs about a dozen small launches per layer
(two RMSNorms, two rotations, two cache writes, the GQA reshape); at batch 1 each costs
more in launch latency than in bandwidth. This kernel does all of it in one launch, one
program per (token, head), reading the start position from the device. Every op rounds
where the eager op rounds (to the storage dtype), so bf16 results follow the eager path.

Imported only on CUDA (Triton is a GPU dependency of torch).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


COUNTERS = 1 << 16  # arrival counters per (device, stream): tiles (or rows) of one launch, at most
_COUNTERS: dict[tuple, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """int32 zeros for "last arriver" kernels (split-K GEMVs, the fused router) launched on the current stream: each
    such kernel takes a counter per tile with an acquire-release atomic and the last program to arrive resets it, so
    kernels of one stream can share them. Never freed or replaced: a captured CUDA graph keeps their address (a
    capture allocates its own, on its stream)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


_SMS: dict[int, int] = {}


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 132 (an H200's) for the interpreter's CPU tensors."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


# --- programmatic dependent launch (PDL) -------------------------------------------------------
# A decode step is ~10 small memory-bound kernels a layer; between two of them the GPU drains one
# grid, then launches and ramps the next. A kernel launched with programmatic stream serialization
# (sm_90+) may be scheduled while its predecessor still runs: its programs start, wait in
# `griddepcontrol.wait` until the predecessor has finished and its writes are visible, and only
# then read activations or write anything. Every kernel that takes `**pdl(device)` begins with
# `pdl_enter(PDL)` (wait, then let its own successor launch), so each waits for the one before it
# and completion stays transitive along the chain; a kernel without it (cuBLAS, torch ops) is a
# full barrier as before. CUDA graphs capture the launches as programmatic edges.
PDL = os.environ.get("DRAFTFLOW_PDL", "1") != "0"  # DRAFTFLOW_PDL=0 turns it off (e.g. a driver that cannot capture
# programmatic launches in a CUDA graph, CUDA < 12.3); benchmarks/gpu_moe_fused.py --step-variants times both
_PDL_DEVICES: dict[int, bool] = {}


def _launch_pdl_supported() -> bool:
    try:
        import dataclasses

        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover (a Triton without the NVIDIA backend)
        return False
    return "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}


def pdl(device: torch.device) -> dict:
    """Launch options for a kernel whose first statement is `pdl_enter(PDL)`: {PDL, launch_pdl} on an sm_90+ GPU with
    PDL set and a Triton that has the option; {} elsewhere (the interpreter, older GPUs), where the kernel runs as
    any other."""
    if not PDL or device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PDL_DEVICES:
        _PDL_DEVICES[index] = torch.cuda.get_device_capability(index)[0] >= 9 and _launch_pdl_supported()
    return {"PDL": True, "launch_pdl": True} if _PDL_DEVICES[index] else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    # wait for the predecessor grid (its writes visible), then allow this grid's successor to launch
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def round_like(x, IS_BF16: tl.constexpr):  # public: a building block for kernels in plugins (conv_kernel.py)
    # The eager path stores every intermediate in the model dtype; round the same way (to
    # nearest, ties to even). Done on the bits: the compiler folds a float32 -> bf16 ->
    # float32 cast pair away, which would silently keep full precision.
    if IS_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _qk_rope_write_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, start_ptr,  # inputs
    q_ptr, k_cache_ptr, v_cache_ptr,  # outputs
    stride_row, stride_cache_b, stride_cache_pos, stride_rope_b, stride_start, eps, W, Q_FROM,
    QH: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr, IS_BF16: tl.constexpr,
    PDL: tl.constexpr = False, POSITIONS: tl.constexpr = False,
):
    # qkv: [B*W, (QH+2*KVH)*D]; cos, sin: [W, D] shared or [B, W, D] per row (stride_rope_b 0 or W*D);
    # start: [1] shared or [B] per row (stride_start 0 or 1); q: [B, KVH, G*(W-Q_FROM), D];
    # caches: [B, capacity, KVH, D]
    # POSITIONS (B = 1, a DFlash block forward): cos_ptr holds inv_freq [D/2] (the tables are computed here),
    # start_ptr each row's position [W]; rows before Q_FROM are
    # context rows (keys and values only, no query), written only below the block's first position (row Q_FROM's):
    # a stale padded context row at or past it lands on a block cell, which that block row writes
    pdl_enter(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    b = row // W
    w = row % W
    HALF: tl.constexpr = D // 2
    G: tl.constexpr = QH // KVH
    dtype = q_ptr.dtype.element_ty
    offs = tl.arange(0, HALF)
    src = qkv_ptr + row * stride_row + head * D
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + HALF + offs).to(tl.float32)
    lane = offs * 0  # POSITIONS' store masks are vectors (the interpreter takes no scalar mask)
    live = lane == 0
    if POSITIONS:
        pos = tl.load(start_ptr + w)
        live = (lane + w >= Q_FROM) | (lane + pos < tl.load(start_ptr + Q_FROM))
    else:
        pos = tl.load(start_ptr + b * stride_start) + w
    cos_ptr += b * stride_rope_b
    sin_ptr += b * stride_rope_b
    if head < QH + KVH:
        if HAS_NORM:  # model.RMSNorm: float32 statistics, cast, then the weight
            inv = tl.math.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
            if head < QH:
                n1 = tl.load(q_norm_ptr + offs).to(tl.float32)
                n2 = tl.load(q_norm_ptr + HALF + offs).to(tl.float32)
            else:
                n1 = tl.load(k_norm_ptr + offs).to(tl.float32)
                n2 = tl.load(k_norm_ptr + HALF + offs).to(tl.float32)
            x1 = round_like(n1 * round_like(x1 * inv, IS_BF16), IS_BF16)
            x2 = round_like(n2 * round_like(x2 * inv, IS_BF16), IS_BF16)
        if POSITIONS:  # cos_ptr: inv_freq [D/2]; cos and sin of pos * inv_freq rounded as rope_tables rounds them
            f = pos.to(tl.float32) * tl.load(cos_ptr + offs)
            c1 = round_like(tl.cos(f), IS_BF16)
            s1 = round_like(tl.sin(f), IS_BF16)
            c2 = c1
            s2 = s1
        else:
            c1 = tl.load(cos_ptr + w * D + offs).to(tl.float32)
            c2 = tl.load(cos_ptr + w * D + HALF + offs).to(tl.float32)
            s1 = tl.load(sin_ptr + w * D + offs).to(tl.float32)
            s2 = tl.load(sin_ptr + w * D + HALF + offs).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        o1 = round_like(round_like(x1 * c1, IS_BF16) + round_like(-x2 * s1, IS_BF16), IS_BF16)
        o2 = round_like(round_like(x2 * c2, IS_BF16) + round_like(x1 * s2, IS_BF16), IS_BF16)
        if head < QH:  # query head h = kvh*G + g goes to row g*W' + w of its KV head's group (W' = W - Q_FROM)
            dst = q_ptr + ((b * KVH + head // G) * (G * (W - Q_FROM)) + (head % G) * (W - Q_FROM) + w - Q_FROM) * D
            live = lane + w >= Q_FROM
        else:
            dst = k_cache_ptr + b * stride_cache_b + pos * stride_cache_pos + (head - QH) * D
    else:
        o1 = x1
        o2 = x2
        dst = v_cache_ptr + b * stride_cache_b + pos * stride_cache_pos + (head - QH - KVH) * D
    if POSITIONS:
        tl.store(dst + offs, o1.to(dtype), mask=live)
        tl.store(dst + HALF + offs, o2.to(dtype), mask=live)
    else:  # the target's window: every store, unmasked as before
        tl.store(dst + offs, o1.to(dtype))
        tl.store(dst + HALF + offs, o2.to(dtype))


def qk_rope_write(
    qkv: torch.Tensor,  # [B, W, (QH + 2*KVH) * D], the fused projection's output
    cos: torch.Tensor,  # [W, D], or [B, W, D] per row
    sin: torch.Tensor,  # [W, D], or [B, W, D]
    q_norm: torch.Tensor | None,  # [D] or None (no q/k norm)
    k_norm: torch.Tensor | None,  # [D]
    start: torch.Tensor,  # [1] int64, or [B] per row
    k_cache: torch.Tensor,  # [B, capacity, KVH, D], one layer's keys
    v_cache: torch.Tensor,  # [B, capacity, KVH, D]
    num_heads: int,
    eps: float,
) -> torch.Tensor:  # q: [B, KVH, G*W, D], query groups folded into rows
    """Normalise and rotate q and k, write k and v at positions start..start+W-1 (per row), return q grouped for attention."""
    b, w, _ = qkv.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    q = torch.empty(b, kvh, (num_heads // kvh) * w, d, dtype=qkv.dtype, device=qkv.device)
    has_norm = q_norm is not None
    _qk_rope_write_kernel[(b * w, num_heads + 2 * kvh)](
        qkv, cos, sin, q_norm if has_norm else qkv, k_norm if has_norm else qkv, start,
        q, k_cache, v_cache,
        qkv.stride(1), k_cache.stride(0), k_cache.stride(1), w * d if cos.dim() == 3 else 0,
        1 if start.shape[0] > 1 else 0, eps, w, 0,
        QH=num_heads, KVH=kvh, D=d, HAS_NORM=has_norm, IS_BF16=qkv.dtype == torch.bfloat16, num_warps=1,
        **pdl(qkv.device),
    )
    return q


def block_rope_write(
    qkv: torch.Tensor,  # [1, T, (QH + 2*KVH) * D]: C context rows, then the block's rows
    positions: torch.Tensor,  # [T] int64: each row's cache position (the block's consecutive)
    inv_freq: torch.Tensor,  # [D/2] float32: RoPE's frequencies (cos and sin of position x inv_freq, as rope_tables)
    q_norm: torch.Tensor | None,  # [D] or None
    k_norm: torch.Tensor | None,  # [D]
    context_rows: int,  # C
    k_cache: torch.Tensor,  # [1, capacity, KVH, D], one layer's keys
    v_cache: torch.Tensor,  # [1, capacity, KVH, D]
    num_heads: int,
    eps: float,
) -> torch.Tensor:  # q: [1, KVH, G*(T-C), D], the block rows' queries folded as decode_attention takes them
    """`qk_rope_write` for a DFlash block forward (context rows and block rows in one launch, RoPE's tables
    computed in the kernel): every row's k and v normalised, rotated and written at its own position, except
    context rows at or past the block's first position (stale rows padding a CUDA graph's fixed shape: the block
    writes those cells); queries for the block rows only."""
    _, t, _ = qkv.shape
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    q = torch.empty(1, kvh, (num_heads // kvh) * (t - context_rows), d, dtype=qkv.dtype, device=qkv.device)
    has_norm = q_norm is not None
    _qk_rope_write_kernel[(t, num_heads + 2 * kvh)](
        qkv, inv_freq, inv_freq, q_norm if has_norm else qkv, k_norm if has_norm else qkv, positions,
        q, k_cache, v_cache,
        qkv.stride(1), k_cache.stride(0), k_cache.stride(1), 0, 0, eps, t, context_rows,
        QH=num_heads, KVH=kvh, D=d, HAS_NORM=has_norm, IS_BF16=qkv.dtype == torch.bfloat16, POSITIONS=True,
        num_warps=1, **pdl(qkv.device),
    )
    return q


@triton.jit
def _attn_split_kernel(
    q_ptr, k_ptr, v_ptr, start_ptr,  # inputs
    m_ptr, l_ptr, acc_ptr,  # per-split partial results
    stride_cache_b, stride_cache_pos, stride_start, scale, W, R, NSPLIT, span,
    KVH: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IS_FP32: tl.constexpr,
    PDL: tl.constexpr = False, CAUSAL: tl.constexpr = True, SLIDING: tl.constexpr = False,
):
    # q: [B, KVH, R, D] with row r = g*W + w; caches: [B, capacity, KVH, D]; one program per
    # (b, kvh, key block, block of BLOCK_R rows). CAUSAL False: every row sees the whole window (a DFlash block)
    pdl_enter(PDL)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // KVH
    kvh = bh % KVH
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, D)
    keys = split * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(start_ptr + b * stride_start)  # this row's window start (stride 0: one for all rows)
    is_key = keys < start + W  # cells past the window are stale or unwritten
    q = tl.load(q_ptr + (bh * R + rows[:, None]) * D + dims[None, :], mask=rows[:, None] < R, other=0.0)
    cells = b * stride_cache_b + keys[:, None] * stride_cache_pos + kvh * D + dims[None, :]
    k = tl.load(k_ptr + cells, mask=is_key[:, None], other=0.0)
    v = tl.load(v_ptr + cells, mask=is_key[:, None], other=0.0)
    if IS_FP32:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if CAUSAL:
        visible = keys[None, :] <= (start + rows % W)[:, None]  # [BLOCK_R, BLOCK_N]: causal within the window
    else:
        visible = is_key[None, :] & (rows[:, None] >= 0)  # [BLOCK_R, BLOCK_N]
    if SLIDING:  # a sliding-window layer: the row at position p sees keys after p - span only
        visible = visible & (keys[None, :] > (start + rows % W - span)[:, None])
    # A large finite floor instead of -inf: a row may see nothing in this block, and -inf - -inf is NaN.
    s = tl.where(visible, s * scale, -1.0e30)
    m = tl.max(s, 1)
    p = tl.where(visible, tl.exp(s - m[:, None]), 0.0)
    if IS_FP32:
        acc = tl.dot(p, v, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v)
    out = (bh * NSPLIT + split) * R + rows
    tl.store(m_ptr + out, m, mask=rows < R)
    tl.store(l_ptr + out, tl.sum(p, 1), mask=rows < R)
    tl.store(acc_ptr + out[:, None] * D + dims[None, :], acc, mask=rows[:, None] < R)


@triton.jit
def _attn_combine_kernel(
    m_ptr, l_ptr, acc_ptr, o_ptr, W, R,
    NSPLIT: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False,
):
    # One program per (b, kvh, row): merge the key blocks' partials; write o [B, W, KVH*G*D]. Blocks past
    # the window saw no key (l = 0, m = the floor), so they weigh nothing.
    pdl_enter(PDL)
    bh = tl.program_id(0)
    r = tl.program_id(1)
    b = bh // KVH
    kvh = bh % KVH
    dims = tl.arange(0, D)
    top = tl.full([1], -1.0e30, dtype=tl.float32)
    for s in range(NSPLIT):
        top = tl.maximum(top, tl.load(m_ptr + (bh * NSPLIT + s) * R + r))
    total = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    for s in range(NSPLIT):
        idx = (bh * NSPLIT + s) * R + r
        weight = tl.exp(tl.load(m_ptr + idx) - top)
        total += weight * tl.load(l_ptr + idx)
        acc += weight * tl.load(acc_ptr + idx * D + dims)
    w = r % W
    g = r // W
    tl.store(o_ptr + ((b * W + w) * (KVH * G) + kvh * G + g) * D + dims, (acc / total).to(o_ptr.dtype.element_ty))


# (Tried on 2026-12-01: the split kernel's last program merging the blocks, one launch instead of two. On the H200
# it took the Qwen3-8B decode step from 4.700 to 4.626 ms but made 16-token verify windows slower, 4.921 -> 5.030 ms
# (8B) and 5.19 -> 5.70 ms (30B-A3B MoE), even where a window kept the combine kernel; not kept.)
ATTN_BLOCK_N = 64  # keys per program: a 256-key bucket gives 4 programs per KV head, 4096 keys 64
FP32_ROWS = 16  # float32 windows: query rows per program (tl.dot's smallest M)


def decode_attention(
    q: torch.Tensor,  # [B, KVH, G*W, D], row g*W + w
    k_cache: torch.Tensor,  # [B, capacity, KVH, D], one layer's keys
    v_cache: torch.Tensor,  # [B, capacity, KVH, D]
    start: torch.Tensor,  # [1] int64: position of the window's first token; or [B]: per row
    w: int,
    bucket: int,  # keys [0, bucket) are considered (the largest end over the rows); the grid depends only on it
    causal: bool = True,  # False: every row sees keys [0, start + W), the whole window (a DFlash block's rows)
    span: int | None = None,  # a sliding window: the row at position p sees keys after p - span only
) -> torch.Tensor:  # [B, W, KVH*G*D], o_proj's input layout
    """Causal attention of a W-token window over the cache, split over key blocks (flash-decoding).

    Key blocks run in parallel and a second kernel merges their softmax partials, so the
    time stays flat in context length instead of growing on a few multiprocessors.
    """
    b, kvh, rows, d = q.shape
    nsplit = triton.cdiv(bucket, ATTN_BLOCK_N)
    m = torch.empty(b * kvh, nsplit, rows, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(b * kvh, nsplit, rows, d, dtype=torch.float32, device=q.device)
    fp32 = q.dtype == torch.float32
    # float32 dots run on the CUDA cores, so a window's rows are split over programs (FP32_ROWS each) to use more
    # multiprocessors; half-precision dots run on tensor cores and take every row at once, reading K/V once.
    block_r = FP32_ROWS if fp32 else max(16, triton.next_power_of_2(rows))
    _attn_split_kernel[(b * kvh, nsplit, triton.cdiv(rows, block_r))](
        q, k_cache, v_cache, start, m, l, acc,
        k_cache.stride(0), k_cache.stride(1), 1 if start.shape[0] > 1 else 0, d ** -0.5, w, rows, nsplit, span or 0,
        KVH=kvh, D=d, BLOCK_R=block_r, BLOCK_N=ATTN_BLOCK_N, IS_FP32=fp32, CAUSAL=causal, SLIDING=span is not None,
        num_warps=4, **pdl(q.device),
    )
    out = torch.empty(b, w, rows // w * kvh * d, dtype=q.dtype, device=q.device)
    _attn_combine_kernel[(b * kvh, rows)](
        m, l, acc, out, w, rows, NSPLIT=nsplit, KVH=kvh, G=rows // w, D=d, num_warps=1, **pdl(q.device),
    )
    return out


# --- elementwise pieces: residual add + RMSNorm, SiLU gate ------------------------------------
# Hand-written rather than torch.compile'd: Triton caches compiled kernels on disk by source and
# constants, so a fresh process loads them in milliseconds instead of re-tracing with dynamo
# (the compile was most of the warm-up, docs/BENCHMARKS.md). Rounding follows the plain ops.
@triton.jit
def add_rms_row(x_ptr, d_ptr, w_ptr, cols, live, H, eps, HAS_DELTA: tl.constexpr, OFFSET: tl.constexpr,
                IS_BF16: tl.constexpr):
    # One row: (sum = x + delta rounded like the storage dtype, RMSNorm(sum) rounded where the plain ops round), both
    # float32 [BLOCK]
    s = tl.load(x_ptr + cols, mask=live, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(d_ptr + cols, mask=live, other=0.0)
        s = round_like(s + delta.to(tl.float32), IS_BF16)
    h = s * tl.math.rsqrt(tl.sum(s * s, 0) / H + eps)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    if OFFSET:  # (h * (1 + w)) in float32, one rounding
        y = h * (1.0 + w)
    else:  # w * h.to(dtype): round h, then the product
        y = round_like(w * round_like(h, IS_BF16), IS_BF16)
    return s, y


@triton.jit
def _add_rms_kernel(
    x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, H, eps,
    BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, OFFSET: tl.constexpr, IS_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # One program per row: sum = x + delta (rounded like the storage dtype), out = RMSNorm(sum)
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < H
    s, y = add_rms_row(x_ptr + row * H, d_ptr + row * H, w_ptr, cols, live, H, eps, HAS_DELTA, OFFSET, IS_BF16)
    if HAS_DELTA:
        tl.store(sum_ptr + row * H + cols, s.to(sum_ptr.dtype.element_ty), mask=live)
    tl.store(out_ptr + row * H + cols, y.to(out_ptr.dtype.element_ty), mask=live)


def add_rms(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
            offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm of it) in one launch; `delta` None: (x, RMSNorm(x)). float32 / bfloat16, contiguous rows."""
    # x, delta: [..., H]; weight: [H]
    h = x.shape[-1]
    total = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    _add_rms_kernel[(x.numel() // h,)](
        x, delta if delta is not None else x, weight, total, out, h, eps,
        BLOCK=triton.next_power_of_2(h), HAS_DELTA=delta is not None, OFFSET=offset,
        IS_BF16=x.dtype == torch.bfloat16, num_warps=8 if h >= 2048 else 4, **pdl(x.device),
    )
    return total, out


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, I, stride_row, BLOCK: tl.constexpr, IS_BF16: tl.constexpr,
                     PDL: tl.constexpr = False):
    # One program per (row, block of columns): silu(gate) rounded, times up, rounded on store
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < I
    g = tl.load(g_ptr + row * stride_row + cols, mask=live, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_row + cols, mask=live, other=0.0).to(tl.float32)
    s = round_like(g / (1.0 + tl.exp(-g)), IS_BF16)
    tl.store(out_ptr + row * I + cols, (s * u).to(out_ptr.dtype.element_ty), mask=live)


SILU_BLOCK = 1024


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for row-strided views of one [..., 2I] product (gate, then up); returns [..., I] contiguous."""
    i = gate.shape[-1]
    rows = gate.numel() // i
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _silu_mul_kernel[(rows, triton.cdiv(i, SILU_BLOCK))](
        gate, up, out, i, gate.stride(-2), BLOCK=SILU_BLOCK, IS_BF16=gate.dtype == torch.bfloat16, num_warps=4,
        **pdl(gate.device),
    )
    return out
