"""The few-token path of the fused MoE (`moe_kernels.fused_experts`): decode and windows of <= SMALL_MAX_PAIRS
(token, expert) pairs and <= SMALL_MAX_TOKENS tokens, in two launches.

Also `expert_weights`, where every fused MoE kernel finds an expert's weights: its slot, or
the pinned host stacks for an expert with no slot. Imported only on CUDA paths, or by tests
through Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from draftflow.layers.triton_kernels import round_like, multiprocessors, pdl, pdl_enter

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SMALL_MAX_PAIRS = 32
SMALL_MAX_TOKENS = 8
GATE_UP_BLOCK_H = 256  # K (hidden) per gate/up loop step
DOWN_BLOCK_J = 256  # K (expert width) per down loop step


@triton.jit
def expert_weights(e, slot_ptr, w_ptr, host_ptr, S, stride_slot, stride_host):
    # (expert e's weights: its slot in w, or on a miss the pinned host stack (mapped into the device's address
    # space); whether it is resident)
    slot = tl.load(slot_ptr + e).to(tl.int64)
    resident = slot < S
    if resident:
        base = w_ptr + slot * stride_slot
    else:
        base = host_ptr + e * stride_host
    return base, resident


# ---- The few-token path (decode, windows of <= SMALL_MAX_PAIRS (token, expert) pairs) ----
# One token reads 8 experts: the grouped kernels above give each program one expert's block of columns and walk
# the whole reduction dimension serially, so few bytes are in flight per multiprocessor and the launch is
# latency-bound. These kernels keep everything in registers (no tensor-core tiles: a GEMV), load wide
# [columns x 256] weight tiles per iteration, split the gate/up reduction over K chunks so there are >= 4 programs
# per multiprocessor, and fold every reduction into the last program to finish ("last arriver": a per-tile counter
# taken with an acquire-release atomic after a barrier, reset by that program; partials are summed in a fixed
# order, so results are deterministic). Two launches: gate/up (+ SiLU gate), down (+ the routing-weighted sum).
@triton.jit
def _lead_of(ids_ptr, e, p, N, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KP: tl.constexpr):
    # (1 when pair p is the first pair routed to expert e, else 0; [BLOCK_T] tokens routed to e; their pairs)
    toks = tl.arange(0, BLOCK_T)
    kp = tl.arange(0, BLOCK_KP)
    pairs = toks[:, None] * K + kp[None, :]
    routed = tl.load(ids_ptr + pairs, mask=(toks[:, None] < N) & (kp[None, :] < K), other=-1)
    match = routed == e
    first = tl.min(tl.min(tl.where(match, pairs, N * K), 1), 0)
    lead = (first == p).to(tl.int32)
    uses = tl.sum(match.to(tl.int32), 1) * lead  # [BLOCK_T] 1 where the token is routed to e (lead only)
    pair = tl.sum(tl.where(match, pairs, 0), 1)
    return lead, uses, pair, toks


@triton.jit
def _pick(vec, toks, tt):
    # vec[tt] as a scalar (a static row index into a [BLOCK_T] vector)
    return tl.sum(tl.where(toks == tt, vec, 0), 0)


@triton.jit
def _gate_up_small_kernel(
    x_ptr, ids_ptr, slot_ptr, w_ptr, host_ptr, part_ptr, act_ptr, tally_ptr, count_ptr,
    N, H, I, E, S, stride_slot, stride_host, CHUNK,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KP: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
    SPLIT: tl.constexpr, IS_BF16: tl.constexpr, PDL: tl.constexpr = False,
):
    # x: [N, H]; ids: [N, K]; w: [S, 2I, H] slots, host: [E, 2I, H]; part: [SPLIT, N*K, 2I] float32 partial
    # gate/up products over K chunks of CHUNK columns; act: [N*K, I] = silu(gate) * up; count: [N*K * cdiv(I,
    # BLOCK_I)] zeros. One program per (pair p, block of I columns, K chunk s); only the first pair of each expert
    # works (for every token routed to that expert)
    pdl_enter(PDL)
    p = tl.program_id(0)
    cb = tl.program_id(1)
    s = tl.program_id(2)
    e = tl.load(ids_ptr + p)
    wg, resident = expert_weights(e, slot_ptr, w_ptr, host_ptr, S, stride_slot, stride_host)
    lead, uses, pair, toks = _lead_of(ids_ptr, e, p, N, K, BLOCK_T, BLOCK_KP)
    cols = cb * BLOCK_I + tl.arange(0, BLOCK_I)
    col_live = cols < I
    hs = tl.arange(0, BLOCK_H)
    acc_g = tl.zeros([BLOCK_T, BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_T, BLOCK_I], dtype=tl.float32)
    lo = s * CHUNK
    hi = tl.minimum(lo + CHUNK, H)
    for h0 in range(lo, tl.where(lead > 0, hi, lo), BLOCK_H):  # programs that do not lead read nothing
        h = h0 + hs
        h_live = h < hi
        w_mask = col_live[:, None] & h_live[None, :]
        g = tl.load(wg + cols[:, None] * H + h[None, :], mask=w_mask, other=0.0).to(tl.float32)  # [BLOCK_I, BLOCK_H]
        u = tl.load(wg + (cols[:, None] + I) * H + h[None, :], mask=w_mask, other=0.0).to(tl.float32)
        for tt in tl.static_range(BLOCK_T):
            used = (hs * 0 + _pick(uses, toks, tt)) > 0  # a vector compare: the interpreter mistypes 0-d bools
            xt = tl.load(x_ptr + tt * H + h, mask=h_live & used, other=0.0).to(tl.float32)  # [BLOCK_H]
            row = toks[:, None] == tt
            acc_g = tl.where(row, acc_g + tl.sum(g * xt[None, :], 1)[None, :], acc_g)
            acc_u = tl.where(row, acc_u + tl.sum(u * xt[None, :], 1)[None, :], acc_u)
    live = (uses[:, None] > 0) & col_live[None, :]
    rows = pair[:, None].to(tl.int64)
    P = N * K
    if SPLIT == 1:
        gate = round_like(acc_g, IS_BF16)
        up = round_like(acc_u, IS_BF16)
    else:
        mine = part_ptr + (s * P + rows) * (2 * I) + cols[None, :]
        tl.store(mine, acc_g, mask=live)
        tl.store(mine + I, acc_u, mask=live)
        tl.debug_barrier()  # every thread's partials are written before the release below
        done = tl.atomic_add(count_ptr + p * tl.num_programs(1) + cb, lead, sem="acq_rel") + lead
        last = (cols[None, :] * 0 + done) == SPLIT  # [1, BLOCK_I]: this program reduces
        live = live & last
        sum_g = tl.zeros([BLOCK_T, BLOCK_I], dtype=tl.float32)
        sum_u = tl.zeros([BLOCK_T, BLOCK_I], dtype=tl.float32)
        for sp in tl.static_range(SPLIT):  # the K chunks in order: deterministic
            theirs = part_ptr + (sp * P + rows) * (2 * I) + cols[None, :]
            sum_g += tl.load(theirs, mask=live, other=0.0, cache_modifier=".cg")
            sum_u += tl.load(theirs + I, mask=live, other=0.0, cache_modifier=".cg")
        gate = round_like(sum_g, IS_BF16)
        up = round_like(sum_u, IS_BF16)
        if done == SPLIT:
            tl.store(count_ptr + p * tl.num_programs(1) + cb, 0)  # ready for the next launch (or graph replay)
    sg = round_like(gate / (1.0 + tl.exp(-gate)), IS_BF16)
    tl.store(act_ptr + rows * I + cols[None, :], (sg * up).to(act_ptr.dtype.element_ty), mask=live)
    tokens = tl.sum(uses, 0)
    counted = (tokens > 0) & (cb == 0) & (s == 0)
    tl.atomic_add(tally_ptr + e, tokens, mask=counted)
    tl.atomic_add(tally_ptr + E, 1, mask=counted & resident)
    tl.atomic_add(tally_ptr + E + 1, 1, mask=counted & ~resident)


@triton.jit
def _down_small_kernel(
    act_ptr, ids_ptr, route_w_ptr, slot_ptr, w_ptr, host_ptr, z_ptr, out_ptr, count_ptr,
    N, H, I, S, stride_slot, stride_host,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
    IS_BF16: tl.constexpr, PDL: tl.constexpr = False,
):
    # act: [N*K, I]; w: [S, H, I]; z: [N*K, H] float32 = round(round(act W_d^T) * route_w) per pair; out: [N, H] =
    # sum over j of z[t*K + j] in the order j = 0..K-1, by the last program of each column block (count: [cdiv(H,
    # BLOCK_N)] zeros). One program per (pair p, block of H columns); only the first pair of each expert works.
    pdl_enter(PDL)
    p = tl.program_id(0)
    cb = tl.program_id(1)
    e = tl.load(ids_ptr + p)
    wd, _ = expert_weights(e, slot_ptr, w_ptr, host_ptr, S, stride_slot, stride_host)
    lead, uses, pair, toks = _lead_of(ids_ptr, e, p, N, K, BLOCK_T, BLOCK_KP)
    cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_live = cols < H
    js = tl.arange(0, BLOCK_J)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for i0 in range(0, tl.where(lead > 0, I, 0), BLOCK_J):
        j = i0 + js
        j_live = j < I
        w = tl.load(wd + cols[:, None] * I + j[None, :], mask=col_live[:, None] & j_live[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_J]
        for tt in tl.static_range(BLOCK_T):
            used = (js * 0 + _pick(uses, toks, tt)) > 0
            a = tl.load(act_ptr + _pick(pair, toks, tt).to(tl.int64) * I + j, mask=j_live & used,
                        other=0.0).to(tl.float32)
            acc = tl.where(toks[:, None] == tt, acc + tl.sum(w * a[None, :], 1)[None, :], acc)
    rows = pair[:, None].to(tl.int64)
    live = (uses[:, None] > 0) & col_live[None, :]
    weight = tl.load(route_w_ptr + pair, mask=uses > 0, other=0.0).to(tl.float32)  # [BLOCK_T]
    z = round_like(round_like(acc, IS_BF16) * weight[:, None], IS_BF16)  # the expert row in the storage dtype, then weighted
    tl.store(z_ptr + rows * H + cols[None, :], z, mask=live)
    tl.debug_barrier()  # every thread's rows are written before the release below
    done = tl.atomic_add(count_ptr + cb, 1, sem="acq_rel") + 1
    last = (cols * 0 + done) == N * K  # every pair's program arrived (non-leading ones included)
    mask = (toks[:, None] < N) & (col_live & last)[None, :]
    total = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for jj in tl.static_range(K):  # fixed order over the top-k
        total += tl.load(z_ptr + (toks[:, None] * K + jj).to(tl.int64) * H + cols[None, :], mask=mask, other=0.0,
                         cache_modifier=".cg")
    tl.store(out_ptr + toks[:, None].to(tl.int64) * H + cols[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)
    if done == N * K:
        tl.store(count_ptr + cb, 0)  # ready for the next launch (or graph replay)


def small_config(tokens: int, pairs: int, h: int, i: int, device: torch.device) -> tuple[int, int, int]:
    """(gate/up columns per program, K chunks of gate/up, down columns per program) for the few-token kernels: >= 4
    programs per multiprocessor where the shape allows, each K chunk at least two 256-wide tiles."""
    if _INTERPRETED:
        return 64, 2, 64  # the interpreter pays per program: wide tiles (and the split reduce exercised)
    # sm_90 (ptxas, 4 warps, no spills): gate/up 16 columns x 256 of K take 96 registers at 1 token, 128 at 4
    # (32 columns: 168 and 255); down 16 / 32 columns take 56 / 80 at 1 token, 72 / 128 at 4 (64: 128 / 255)
    # (test_moe_kernels_compile.py prints these). Gate/up takes 8 columns: at the 30B shape's decode (8 pairs x 768
    # columns) that is 768 programs and no K split, one layer's experts in 25.2 us on the H200 against 27.9 for 16
    # columns split in 2 and 25.9 for 16 unsplit (benchmarks/gpu_moe_fused.py --quick, 2026-12-01).
    want = 4 * multiprocessors(device)
    many = tokens > 4
    block_i = 8
    split = max(1, min(triton.cdiv(want, pairs * triton.cdiv(i, block_i)), h // 512))
    block_n = 16 if many or pairs * triton.cdiv(h, 32) < want else 32
    return block_i, split, block_n


def counter_size(h: int, i: int) -> int:
    """int32 counters the few-token kernels need (zeros; they leave them zeroed), at any config they accept."""
    return SMALL_MAX_PAIRS * triton.cdiv(i, 8) + triton.cdiv(h, 16)


def small_experts(x, ids, weights, gate_up, down, slot_of, tally, host_gate_up, host_down, out, config, counters):
    """The two few-token launches."""
    n, k = ids.shape
    h, i = x.shape[1], down.shape[2]
    pairs = n * k
    block_i, split, block_n = config or small_config(n, pairs, h, i, x.device)
    if block_i < 8 or block_n < 16 or split < 1:
        raise ValueError(f"few-token MoE config {(block_i, split, block_n)}: needs >= 8 gate/up columns, >= 16 down "
                         "columns and >= 1 K chunk")
    if counters is None:
        counters = torch.zeros(counter_size(h, i), dtype=torch.int32, device=x.device)
    n_i, n_h = triton.cdiv(i, block_i), triton.cdiv(h, block_n)
    block_h = max(16, min(GATE_UP_BLOCK_H, triton.next_power_of_2(triton.cdiv(h, split))))
    chunk = triton.cdiv(triton.cdiv(h, split), block_h) * block_h
    split = triton.cdiv(h, chunk)
    is_bf16 = x.dtype == torch.bfloat16
    common = dict(K=k, BLOCK_T=triton.next_power_of_2(n), BLOCK_KP=triton.next_power_of_2(k))
    part = torch.empty(split if split > 1 else 1, pairs, 2 * i, dtype=torch.float32, device=x.device)
    act = torch.empty(pairs, i, dtype=x.dtype, device=x.device)  # [N*k, I]
    _gate_up_small_kernel[(pairs, n_i, split)](
        x, ids, slot_of, gate_up, host_gate_up, part, act, tally, counters, n, h, i, slot_of.shape[0],
        gate_up.shape[0], gate_up.stride(0), host_gate_up.stride(0), chunk, BLOCK_I=block_i, BLOCK_H=block_h,
        SPLIT=split, IS_BF16=is_bf16, **common, num_warps=4, **pdl(x.device),
    )
    z = torch.empty(pairs, h, dtype=torch.float32, device=x.device)  # [N*k, H]
    _down_small_kernel[(pairs, n_h)](
        act, ids, weights, slot_of, down, host_down, z, out, counters[SMALL_MAX_PAIRS * triton.cdiv(i, 8):],
        n, h, i,
        gate_up.shape[0], down.stride(0), host_down.stride(0), BLOCK_N=block_n,
        BLOCK_J=DOWN_BLOCK_J if i >= DOWN_BLOCK_J else max(16, triton.next_power_of_2(i)), IS_BF16=is_bf16,
        **common, num_warps=4, **pdl(x.device),
    )
    return out


