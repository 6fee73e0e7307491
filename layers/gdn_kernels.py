"""Triton kernels for a Gated DeltaNet verify window: every position's output and recurrent state.

Rollback by selection (linear_state.py) needs the state after *every* window position, so a
window of T tokens must write T states of Dk x Dv float32 per value head (64 KiB at 128 x 128;
a Qwen3.6-27B-class layer with 48 value heads writes 3 MiB per position, 48 MiB for T = 16).
After the weights, those writes are the window's dominant traffic, and they fix the design:

- The recurrence runs **sequentially over the T <= 32 tokens in one program per (row,
  value head, block of BV value columns)**, the [Dk, BV] state slice in registers, float32.
  Per token the gated delta rule costs ~4 Dk BV flops, the same order as writing the slice
  (4 Dk BV bytes), so there is no compute to save. The chunked WY / UT form (docs/HYBRID.md)
  folds T rank-one updates into matmuls so that only chunk boundaries are sequential; that
  pays when only the final state is wanted. Here every position's state must be
  materialised anyway, which is the very rank-one sequence it avoids, and its triangular
  solve adds rounding the sequential form does not have: the sequential form computes the
  torch reference's arithmetic (`linear_state.delta_step`) op for op, so it is exact to
  float32 summation order.
- The **prologue** (depthwise causal conv + SiLU, q/k L2 norms and scale, beta and the
  decay g) is a separate launch, one program per (row, block of 8 tokens, head): inside the sequential loop
  it would be recomputed by every value-column block of every value head sharing a key head
  and would lengthen the per-token critical path. It also writes the window's conv inputs
  into the tape right after the committed K-1, so the conv state after position t is the
  tape slice [t+1, t+K) and rollback stays a selection (`LinearState.commit` copies it).
- The gated RMSNorm of the output is a third launch (one program per 8 tokens and head),
  replacing about eight small torch ops.

Three launches per layer, none reading a host value: shapes depend only on (B, T), so the
window is capturable in a CUDA graph. bf16 models round where the torch path rounds (conv
and SiLU outputs, the norm's cast); the recurrence is float32 throughout.

Imported only on CUDA (or by tests under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftflow.layers.triton_kernels import round_like

MAX_TOKENS = 32  # longer recorded windows (num_draft > 31) take the torch loop
BLOCK_V = 16  # value columns per recurrence program: 8 programs per 128-wide head
RECURRENCE_WARPS = 4  # 16 state elements per thread: more warps in flight to cover the per-token store stream
PROLOGUE_TOKENS = 8  # window tokens per prologue program


def supported(k_dim: int, v_dim: int, conv_kernel: int, tokens: int) -> bool:
    """Whether the kernels take this window: power-of-two head dims (Triton blocks), a conv with a committed tail,
    at most MAX_TOKENS tokens."""
    return pow2(k_dim) and pow2(v_dim) and conv_kernel >= 2 and 1 <= tokens <= MAX_TOKENS


def pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@triton.jit
def _silu(x, IS_BF16: tl.constexpr):
    return round_like(x / (1.0 + tl.exp(-x)), IS_BF16)


@triton.jit
def _conv_silu(qkvz_ptr, tape_ptr, w_ptr, toks, src, chan, stride_tok, stride_c, T,
               TAIL: tl.constexpr, IS_BF16: tl.constexpr):
    # Causal depthwise conv of one batch row at window tokens `toks` [BT, 1] over channels `chan` [1, D] (at offsets
    # `src` in a qkvz row): tap j reads tape column tok + j, the committed inputs for columns < TAIL, else window
    # token tok + j - TAIL straight from the projection (never from the tape, which this launch is writing).
    live = toks < T
    acc = tl.zeros((toks + src).shape, dtype=tl.float32)  # [BT, D]
    for j in tl.static_range(TAIL + 1):
        col = toks + j
        from_tape = tl.load(tape_ptr + chan * stride_c + tl.minimum(col, TAIL - 1), mask=live & (col < TAIL),
                            other=0.0)
        from_window = tl.load(qkvz_ptr + tl.maximum(col - TAIL, 0) * stride_tok + src, mask=live & (col >= TAIL),
                              other=0.0)
        x = (from_tape + from_window).to(tl.float32)
        acc += tl.load(w_ptr + chan * (TAIL + 1) + j).to(tl.float32) * x
    return _silu(round_like(acc, IS_BF16), IS_BF16)


@triton.jit
def _prologue_kernel(
    qkvz_ptr, ba_ptr, tape_ptr, w_ptr, a_log_ptr, dt_bias_ptr,  # inputs (tape: also written)
    qk_ptr, v_ptr, gb_ptr,  # float32 outputs
    T, NTB, stride_tape_b, stride_tape_c, scale,
    HK: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, TAIL: tl.constexpr, BT: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    # qkvz: [B, T, HK*(2DK + 2R*DV)] contiguous, per key head [q | k | v (R heads) | z (R heads)];
    # ba: [B, T, HK*2R], per key head [b (R) | a (R)]; tape: [B, C, L], channels [q (HK*DK) | k | v (HK*R*DV)];
    # w: [C, 1, TAIL+1]. Program (batch row * NTB + block of BT tokens, head): heads < HK are key heads (q, k), the
    # rest value heads. qk: [B*T, HK, 2, DK] (q scaled); v: [B*T, HK*R, DV]; gb: [B*T, HK*R, 2] (log decay g, beta)
    b = tl.program_id(0) // NTB
    toks = (tl.program_id(0) % NTB) * BT + tl.arange(0, BT)[:, None]  # [BT, 1]
    head = tl.program_id(1)
    live = toks < T
    GROUP: tl.constexpr = 2 * DK + 2 * R * DV
    stride_tok = HK * GROUP
    rows = b * T + toks  # [BT, 1] token rows of qkvz and of the outputs
    qkvz_b = qkvz_ptr + b * T * stride_tok
    tape_b = tape_ptr + b * stride_tape_b
    if head < HK:
        dims = tl.arange(0, DK)[None, :]
        for part in tl.static_range(2):  # 0: q, 1: k
            chan = part * HK * DK + head * DK + dims
            src = head * GROUP + part * DK + dims
            y = _conv_silu(qkvz_b, tape_b, w_ptr, toks, src, chan, stride_tok, stride_tape_c, T, TAIL, IS_BF16)
            raw = tl.load(qkvz_b + toks * stride_tok + src, mask=live, other=0.0)
            tl.store(tape_b + chan * stride_tape_c + TAIL + toks, raw, mask=live)  # the window's inputs, after the tail
            y = y * tl.math.rsqrt(tl.sum(y * y, 1) + 1e-6)[:, None]  # L2 norm in float32, eps as gdn._l2norm
            if part == 0:
                y = y * scale
            tl.store(qk_ptr + ((rows * HK + head) * 2 + part) * DK + dims, y, mask=live)
    else:
        hv = head - HK
        kh = hv // R
        j = hv % R
        dims = tl.arange(0, DV)[None, :]
        chan = 2 * HK * DK + hv * DV + dims
        src = kh * GROUP + 2 * DK + j * DV + dims
        y = _conv_silu(qkvz_b, tape_b, w_ptr, toks, src, chan, stride_tok, stride_tape_c, T, TAIL, IS_BF16)
        raw = tl.load(qkvz_b + toks * stride_tok + src, mask=live, other=0.0)
        tl.store(tape_b + chan * stride_tape_c + TAIL + toks, raw, mask=live)
        tl.store(v_ptr + (rows * HK * R + hv) * DV + dims, y, mask=live)
        tok1 = (tl.program_id(0) % NTB) * BT + tl.arange(0, BT)  # g and beta: one per token
        row1 = b * T + tok1
        live1 = tok1 < T
        beta_in = tl.load(ba_ptr + row1 * HK * 2 * R + kh * 2 * R + j, mask=live1, other=0.0).to(tl.float32)
        a_in = tl.load(ba_ptr + row1 * HK * 2 * R + kh * 2 * R + R + j, mask=live1, other=0.0).to(tl.float32)
        x = a_in + tl.load(dt_bias_ptr + hv).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold
        g = -tl.exp(tl.load(a_log_ptr + hv).to(tl.float32)) * softplus
        tl.store(gb_ptr + (row1 * HK * R + hv) * 2, g, mask=live1)
        tl.store(gb_ptr + (row1 * HK * R + hv) * 2 + 1, 1.0 / (1.0 + tl.exp(-beta_in)), mask=live1)


@triton.jit
def _recurrence_kernel(
    qk_ptr, v_ptr, gb_ptr, rec_ptr, out_ptr, journal_ptr,
    T, stride_slot, stride_rec_b, stride_jt, stride_jb,
    HK: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, SELECT: tl.constexpr,
):
    # rec: [slots, B, HK*R, DK, DV] float32 (slot 0 read, slot t+1 written: the state after token t);
    # out: [B*T, HK*R, DV] float32; journal (replay mode): [W, B, HK*R, DK + DV + 2] float32.
    # Program (value block, row * HV + value head).
    vb = tl.program_id(0)
    bh = tl.program_id(1)
    HV: tl.constexpr = HK * R
    b = bh // HV
    hv = bh % HV
    kh = hv // R
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    cell = hv * (DK * DV) + dk[:, None] * DV + dv[None, :]  # [DK, BV] within a (slot, row)
    slot_ptr = rec_ptr + b * stride_rec_b + cell  # [DK, BV] pointers into slot 0
    s = tl.load(slot_ptr)
    # Token t's inputs are loaded one iteration ahead, so their latency overlaps token t-1's update.
    row = b * T
    q = tl.load(qk_ptr + ((row * HK + kh) * 2) * DK + dk)
    k = tl.load(qk_ptr + ((row * HK + kh) * 2 + 1) * DK + dk)
    v = tl.load(v_ptr + (row * HV + hv) * DV + dv)
    g = tl.load(gb_ptr + (row * HV + hv) * 2)
    beta = tl.load(gb_ptr + (row * HV + hv) * 2 + 1)
    for t in range(T):
        nxt = b * T + tl.minimum(t + 1, T - 1)
        q_next = tl.load(qk_ptr + ((nxt * HK + kh) * 2) * DK + dk)
        k_next = tl.load(qk_ptr + ((nxt * HK + kh) * 2 + 1) * DK + dk)
        v_next = tl.load(v_ptr + (nxt * HV + hv) * DV + dv)
        g_next = tl.load(gb_ptr + (nxt * HV + hv) * 2)
        beta_next = tl.load(gb_ptr + (nxt * HV + hv) * 2 + 1)
        # linear_state.delta_step: S <- a S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
        s = s * tl.exp(g)
        remembered = tl.sum(s * k[:, None], 0)  # [BV]
        delta = (v - remembered) * beta
        s = s + k[:, None] * delta[None, :]
        out = tl.sum(s * q[:, None], 0)
        tl.store(out_ptr + ((b * T + t) * HV + hv) * DV + dv, out)
        if SELECT:  # a pointer stepped per slot: (t + 1) * stride_slot may pass 2^31 at large batches
            slot_ptr += stride_slot
            tl.store(slot_ptr, s)
        else:  # replay mode journals the inputs [k | v | g | beta]; block 0 writes the per-head parts
            entry = journal_ptr + t * stride_jt + b * stride_jb + hv * (DK + DV + 2)
            tl.store(entry + DK + dv, v)
            first = vb == 0
            tl.store(entry + dk, k, mask=(dk * 0 + vb) == 0)
            tl.store(entry + DK + DV, g, mask=first)
            tl.store(entry + DK + DV + 1, beta, mask=first)
        q, k, v, g, beta = q_next, k_next, v_next, g_next, beta_next


def window(
    qkvz: torch.Tensor,  # [B, T, HK*(2DK + 2R*DV)], in_proj_qkvz's output
    ba: torch.Tensor,  # [B, T, HK*2R], in_proj_ba's output
    tape: torch.Tensor,  # [B, C, L] conv inputs: K-1 committed, then the window's (written here)
    conv_weight: torch.Tensor,  # [C, 1, K]
    a_log: torch.Tensor,  # [HV]
    dt_bias: torch.Tensor,  # [HV]
    rec: torch.Tensor,  # [slots, B, HV, DK, DV] float32: slot 0 read; select mode writes slots 1..T
    journal: torch.Tensor | None,  # [W, B, HV, DK + DV + 2] float32 (replay mode), or None (select)
    num_k_heads: int,
    k_dim: int,
    v_dim: int,
    block_v: int | None = None,  # value columns per recurrence program (None: BLOCK_V)
    num_warps: int | None = None,  # warps per recurrence program (None: RECURRENCE_WARPS)
) -> torch.Tensor:  # [B, T, HV, DV] float32, before the gated norm
    """Gated delta rule over a window: conv inputs appended to the tape, every position's output and state."""
    bsz, t, _ = qkvz.shape
    hv = rec.shape[2]
    block_v, num_warps = block_v or BLOCK_V, num_warps or RECURRENCE_WARPS
    r = hv // num_k_heads
    qkvz, ba = qkvz.contiguous(), ba.contiguous()
    if tape.stride(-1) != 1 or rec[0, 0].stride() != (k_dim * v_dim, v_dim, 1) or not pow2(block_v):
        raise ValueError("gdn_kernels.window needs unit-stride tape columns, contiguous state slots and a "
                         "power-of-two block_v")
    tail = conv_weight.shape[-1] - 1
    slots = t + 1 if journal is None else 1
    if (rec.shape[0] < slots or rec.shape[1] != bsz or tape.shape[0] != bsz or tape.shape[-1] < tail + t
            or (journal is not None and (journal.shape[0] < t or journal.shape[1] != bsz))):
        raise ValueError(f"gdn_kernels.window: a window of {bsz} x {t} tokens does not fit the state buffers "
                         f"(tape {tuple(tape.shape)}, states {tuple(rec.shape)}); allocate the LinearState for it")
    conv_weight = conv_weight.contiguous()
    dev = qkvz.device
    qk = torch.empty(bsz * t, num_k_heads, 2, k_dim, dtype=torch.float32, device=dev)
    v = torch.empty(bsz * t, hv, v_dim, dtype=torch.float32, device=dev)
    gb = torch.empty(bsz * t, hv, 2, dtype=torch.float32, device=dev)
    bt = min(triton.next_power_of_2(t), PROLOGUE_TOKENS)
    ntb = triton.cdiv(t, bt)
    _prologue_kernel[(bsz * ntb, num_k_heads + hv)](
        qkvz, ba, tape, conv_weight, a_log, dt_bias, qk, v, gb,
        t, ntb, tape.stride(0), tape.stride(1), k_dim ** -0.5,
        HK=num_k_heads, R=r, DK=k_dim, DV=v_dim, TAIL=tail, BT=bt,
        IS_BF16=qkvz.dtype == torch.bfloat16, num_warps=4,
    )
    out = torch.empty(bsz, t, hv, v_dim, dtype=torch.float32, device=dev)
    bv = min(block_v, v_dim)
    select = journal is None
    jr = rec if select else journal  # an unused pointer in select mode
    _recurrence_kernel[(v_dim // bv, bsz * hv)](
        qk, v, gb, rec, out, jr,
        t, rec.stride(0), rec.stride(1), jr.stride(0), jr.stride(1),
        HK=num_k_heads, R=r, DK=k_dim, DV=v_dim, BV=bv, SELECT=select, num_warps=num_warps,
    )
    return out


@triton.jit
def _gated_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, N, HV, stride_z_tok, stride_z_kh, eps,
                       R: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, IS_BF16: tl.constexpr):
    # Program (block of BT token rows, value head): x [N = B*T, HV, DV] float32 -> cast to the model dtype, RMSNorm
    # with the plain weight, times silu(z) in float32, cast (gdn.GatedRMSNorm's order). z: [N, HK, R*DV], strided.
    rows = tl.program_id(0) * BT + tl.arange(0, BT)[:, None]  # [BT, 1]
    head = tl.program_id(1)
    dims = tl.arange(0, DV)[None, :]
    live = rows < N
    cell = (rows * HV + head) * DV + dims
    x = round_like(tl.load(x_ptr + cell, mask=live, other=0.0), IS_BF16)
    h = round_like(x * tl.math.rsqrt(tl.sum(x * x, 1) / DV + eps)[:, None], IS_BF16)
    y = round_like(tl.load(w_ptr + dims).to(tl.float32) * h, IS_BF16)
    z = tl.load(z_ptr + rows * stride_z_tok + (head // R) * stride_z_kh + (head % R) * DV + dims, mask=live,
                other=0.0).to(tl.float32)
    tl.store(out_ptr + cell, (y * (z / (1.0 + tl.exp(-z)))).to(out_ptr.dtype.element_ty), mask=live)


def gated_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GatedRMSNorm(x.to(z.dtype), z) in one launch, z read in place from the qkvz projection."""
    # x: [B, T, HV, DV] float32 contiguous; z: [B, T, HK, R*DV] (unit stride last); returns [B, T, HV, DV] z.dtype
    bsz, t, hv, dv = x.shape
    if z.stride(-1) != 1 or z.stride(0) != t * z.stride(1):
        z = z.contiguous()
    out = torch.empty(x.shape, dtype=z.dtype, device=x.device)
    n = bsz * t
    bt = min(triton.next_power_of_2(n), PROLOGUE_TOKENS)
    _gated_norm_kernel[(triton.cdiv(n, bt), hv)](x, z, weight, out, n, hv, z.stride(1), z.stride(2), eps,
                                                 R=hv // z.shape[2], DV=dv, BT=bt,
                                                 IS_BF16=z.dtype == torch.bfloat16, num_warps=2)
    return out
