"""Fused MoE for resident experts: routing on the device and two grouped expert launches, no host sync.

The eager expert cache reads every layer's routing back to the host. When every expert a
window routes to is resident, nothing needs the host: these kernels take the expert ids
from a device tensor, so a layer is four launches (the router's GEMV and routing, gate/up,
down, combine; three for decode and windows of <= 32 pairs: see the few-token kernels) and a
decode or verify window can be captured in a CUDA graph.

- Routing (`moe_router.py`, re-exported here): `route_topk` (softmax in float32, top-k,
  optional renormalisation, cast to the activation dtype, as `moe.route`), and `router_topk` /
  `add_rms_route`, the router's GEMV (and the norm before it) with the same routing in one launch.
- `fused_experts`: (1) gate/up + SiLU gate for every routed (token, expert) pair, (2) down,
  (3) the routing-weighted sum over the k pairs of each token. Launches (1) and (2) are
  grouped by expert: a program serves one expert and a block of output columns for *all*
  tokens of the window routed to it, so an expert hit by several tokens of a verify window
  is read once. With few pairs (M = T*k <= E) program p leads the expert of pair p when p
  is that expert's first pair (the others exit at once); otherwise program e serves expert e.
  No sort and no index building: each program finds its tokens by comparing the window's
  [T, k] ids with its expert. The weighted sum is a third launch, in a fixed order over k,
  so results are deterministic (no float atomics) and round where `LayerExperts.compute`
  rounds (gate/up and down outputs in the storage dtype, then weight * row, then the sum).
- Few-token windows (<= SMALL_MAX_PAIRS pairs, <= SMALL_MAX_TOKENS tokens, bf16 / float32:
  decode is 8 pairs at top-8) take the kernels of `moe_few_token.py` instead:
  GEMVs in registers over wide [columns x 256] tiles, gate/up split over K chunks, >= 4
  programs per SM, the chunk reduce (+ SiLU gate) and the top-k sum each done by the last
  program to arrive at a per-tile counter (fixed order; same rounding points as above).

The expert weights are the cache's slots ([S, 2I, H] gate rows then up rows, [S, H, I]);
`slot_of[e]` is expert e's slot, or S when it has none: then the kernels read it from the
pinned host stacks (mapped into the device's address space under unified addressing), the
same bytes through the same code, so the result does not depend on residency. The gate/up
launch tallies, per expert read, its tokens and one hit or one miss (atomics on int32).
Imported only on CUDA paths, or by tests through Triton's interpreter (TRITON_INTERPRET=1)
on CPU tensors.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from draftflow.layers.expert_cache import DEVICE_WINDOW_TOKENS
from draftflow.layers.moe_few_token import (  # noqa: F401 - re-exported: the few-token path's sizes
    SMALL_MAX_PAIRS, SMALL_MAX_TOKENS, counter_size, expert_weights, small_config, small_experts)
from draftflow.layers.moe_router import (  # noqa: F401 - re-exported: the routing launches of the device path
    ROUTER_MAX_TOKENS, add_rms_route, route_topk, router_fits, router_topk)
from draftflow.layers.triton_kernels import round_like

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
FUSED_MAX_TOKENS = DEVICE_WINDOW_TOKENS  # token rows one program holds at once; longer windows loop over blocks
FEW_TOKEN_KERNELS = True  # path="auto" may take them (benchmarks set False to time the grouped kernels instead)


@triton.jit
def _my_rows(ids_ptr, e, p, t0, N, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KP: tl.constexpr, BY_PAIR: tl.constexpr):
    # Tokens t0 .. t0+BLOCK_T-1 routed to expert e: (uses [BLOCK_T] bool, their pair index t*K + j [BLOCK_T]).
    # BY_PAIR (one token block holds the whole window): only the program of e's first pair serves e.
    toks = t0 + tl.arange(0, BLOCK_T)
    kp = tl.arange(0, BLOCK_KP)
    pairs = toks[:, None] * K + kp[None, :]  # [BLOCK_T, BLOCK_KP]
    routed = tl.load(ids_ptr + pairs, mask=(toks[:, None] < N) & (kp[None, :] < K), other=-1)
    match = routed == e  # a token routes to an expert at most once
    uses = tl.sum(match.to(tl.int32), 1) > 0
    pair = tl.sum(tl.where(match, pairs, 0), 1)
    if BY_PAIR:
        first = tl.min(tl.where(uses, pair, N * K), 0)
        uses = uses & (first + 0 * toks == p)  # a vector compare: the interpreter mistypes bool & 0-d bool
    return uses, pair, toks


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, slot_ptr, w_ptr, host_ptr, act_ptr, tally_ptr,
    N, H, I, E, S, stride_slot, stride_host,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KP: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
    BY_PAIR: tl.constexpr, IS_BF16: tl.constexpr, IS_FP32: tl.constexpr,
):
    # x: [N, H]; ids: [N, K]; w: [S, 2I, H] slots (gate rows, then up rows), host: [E, 2I, H]; act: [N*K, I] =
    # silu(x W_g^T) * (x W_u^T) per pair; tally: [E + 2] tokens routed per expert, hits, misses. One program per
    # (pair p or expert e, block of I columns)
    lead = tl.program_id(0)
    cb = tl.program_id(1)
    if BY_PAIR:
        e = tl.load(ids_ptr + lead)
    else:
        e = lead.to(tl.int64)
    wg, resident = expert_weights(e, slot_ptr, w_ptr, host_ptr, S, stride_slot, stride_host)
    cols = cb * BLOCK_I + tl.arange(0, BLOCK_I)
    col_live = cols < I
    hs = tl.arange(0, BLOCK_H)
    served = tl.zeros([BLOCK_T], dtype=tl.int32)  # tokens served, per row of the token block
    for t0 in range(0, N, BLOCK_T):
        uses, pair, toks = _my_rows(ids_ptr, e, lead, t0, N, K, BLOCK_T, BLOCK_KP, BY_PAIR)
        n_used = tl.sum(uses.to(tl.int32), 0)
        served += uses.to(tl.int32)
        acc_g = tl.zeros([BLOCK_T, BLOCK_I], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_T, BLOCK_I], dtype=tl.float32)
        for h0 in range(0, tl.where(n_used > 0, H, 0), BLOCK_H):  # blocks without a routed token read nothing
            h = h0 + hs
            h_live = h < H
            xt = tl.load(x_ptr + toks[:, None].to(tl.int64) * H + h[None, :], mask=uses[:, None] & h_live[None, :],
                         other=0.0)
            w_mask = col_live[:, None] & h_live[None, :]
            g = tl.load(wg + cols[:, None] * H + h[None, :], mask=w_mask, other=0.0)  # [BLOCK_I, BLOCK_H]
            u = tl.load(wg + (cols[:, None] + I) * H + h[None, :], mask=w_mask, other=0.0)
            if IS_FP32:
                acc_g += tl.dot(xt, tl.trans(g), input_precision="ieee")
                acc_u += tl.dot(xt, tl.trans(u), input_precision="ieee")
            else:
                acc_g += tl.dot(xt, tl.trans(g))
                acc_u += tl.dot(xt, tl.trans(u))
        gate = round_like(acc_g, IS_BF16)  # the gate/up product is stored in the model dtype, as F.linear does
        up = round_like(acc_u, IS_BF16)
        s = round_like(gate / (1.0 + tl.exp(-gate)), IS_BF16)
        out = act_ptr + pair[:, None].to(tl.int64) * I + cols[None, :]
        tl.store(out, (s * up).to(act_ptr.dtype.element_ty), mask=uses[:, None] & col_live[None, :])
    # Column block 0 counts, per expert served: its tokens (eviction scores), and one hit or one miss.
    tokens = tl.sum(served, 0)
    counted = (tokens > 0) & (cb == 0)
    tl.atomic_add(tally_ptr + e, tokens, mask=counted)
    tl.atomic_add(tally_ptr + E, 1, mask=counted & resident)
    tl.atomic_add(tally_ptr + E + 1, 1, mask=counted & ~resident)


@triton.jit
def _down_kernel(
    act_ptr, ids_ptr, slot_ptr, w_ptr, host_ptr, y_ptr,
    N, H, I, S, stride_slot, stride_host,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
    BY_PAIR: tl.constexpr, IS_FP32: tl.constexpr,
):
    # act: [N*K, I]; w: [S, H, I]; y: [N*K, H] = act W_d^T per pair; one program per (pair or expert, block of H)
    lead = tl.program_id(0)
    cb = tl.program_id(1)
    if BY_PAIR:
        e = tl.load(ids_ptr + lead)
    else:
        e = lead.to(tl.int64)
    wd, _ = expert_weights(e, slot_ptr, w_ptr, host_ptr, S, stride_slot, stride_host)
    cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_live = cols < H
    js = tl.arange(0, BLOCK_I)
    for t0 in range(0, N, BLOCK_T):
        uses, pair, toks = _my_rows(ids_ptr, e, lead, t0, N, K, BLOCK_T, BLOCK_KP, BY_PAIR)
        n_used = tl.sum(uses.to(tl.int32), 0)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        rows = pair[:, None].to(tl.int64)
        for i0 in range(0, tl.where(n_used > 0, I, 0), BLOCK_I):
            j = i0 + js
            j_live = j < I
            a = tl.load(act_ptr + rows * I + j[None, :], mask=uses[:, None] & j_live[None, :], other=0.0)
            w = tl.load(wd + cols[:, None] * I + j[None, :], mask=col_live[:, None] & j_live[None, :], other=0.0)
            if IS_FP32:
                acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(w))
        tl.store(y_ptr + rows * H + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=uses[:, None] & col_live[None, :])


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr, IS_BF16: tl.constexpr):
    # out[t] = sum_j round(y[t*K + j] * w[t, j]), accumulated in float32 in the order j = 0..K-1
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        weight = tl.load(w_ptr + t * K + j).to(tl.float32)
        y = tl.load(y_ptr + (t * K + j) * H + cols, mask=live, other=0.0).to(tl.float32)
        acc += round_like(y * weight, IS_BF16)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=live)


def _blocks(pairs: int) -> int:
    # Output columns per program: narrow when few experts are routed, so the weight reads still spread over
    # every multiprocessor (a memory-bound GEMV wants several programs per SM). Compiled for sm_90 at the
    # 30B-A3B shape (ptxas, runtime divisibility), 16 or 32 columns keep gate/up under 115 registers and 41 KB of
    # shared memory (three pipeline stages) with no spills; 64 needs 8 warps (the benchmark sweeps it). Triton's
    # interpreter (CPU tests) pays per program: wide tiles there.
    if _INTERPRETED:
        return 64
    return 16 if pairs <= 16 else 32


def few_token_fits(n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether the few-token kernels can serve n tokens at top-k (path="small")."""
    return n * k <= SMALL_MAX_PAIRS and n <= SMALL_MAX_TOKENS and dtype in (torch.bfloat16, torch.float32)


def fused_experts(
    x: torch.Tensor,  # [N, H]
    ids: torch.Tensor,  # [N, k] int64 expert ids
    weights: torch.Tensor,  # [N, k] routing weights
    gate_up: torch.Tensor,  # [S, 2I, H] expert slots: gate rows, then up rows
    down: torch.Tensor,  # [S, H, I]
    slot_of: torch.Tensor,  # [E] int: expert -> slot; S (or more) = not resident, read from `host`
    tally: torch.Tensor,  # [E + 2] int32: += tokens routed to each expert, then hits, then misses (one per expert read)
    host: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([E, 2I, H], [E, H, I]) pinned: every expert
    columns: tuple[int, int] | None = None,  # output columns per program (gate/up, down); None: by the pair count
    path: str = "auto",  # "small" (few-token kernels), "grouped" (the kernels by pair / by expert), "auto": by size
    small: tuple[int, int, int] | None = None,  # few-token (gate/up columns, K chunks, down columns); None: small_config
    counters: torch.Tensor | None = None,  # int32 zeros of counter_size(H, I) the few-token kernels leave zeroed
) -> torch.Tensor:  # [N, H]
    """Sum over k of weight * expert(x) for every token, reading each routed expert once (from its slot, or from
    pinned host memory when it has none). Up to SMALL_MAX_PAIRS (token, expert) pairs (and SMALL_MAX_TOKENS tokens,
    bf16 or float32) take the two few-token launches; larger windows the three grouped ones."""
    n, k = ids.shape
    h, i = x.shape[1], down.shape[2]
    num_experts, slots = slot_of.shape[0], gate_up.shape[0]
    host_gate_up, host_down = host if host is not None else (gate_up, down)  # without host: every expert resident
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    pairs = n * k
    if path == "small" and not few_token_fits(n, k, x.dtype):
        raise ValueError(f"the few-token MoE kernels serve <= {SMALL_MAX_PAIRS} pairs and <= {SMALL_MAX_TOKENS} "
                         f"tokens in bf16 or float32; got {n} tokens x top-{k} in {x.dtype}: use path='auto'")
    if path not in ("auto", "small", "grouped"):
        raise ValueError(f"path={path!r}: expected 'auto', 'small' or 'grouped'")
    if path == "small" or (path == "auto" and FEW_TOKEN_KERNELS and few_token_fits(n, k, x.dtype)):
        return small_experts(x, ids, weights, gate_up, down, slot_of, tally, host_gate_up, host_down, out, small,
                              counters)
    block_t = max(16, min(FUSED_MAX_TOKENS, triton.next_power_of_2(n)))
    by_pair = n <= block_t and pairs <= num_experts  # one token block: program p leads the expert of pair p
    leads = pairs if by_pair else num_experts
    is_bf16, is_fp32 = x.dtype == torch.bfloat16, x.dtype == torch.float32
    act = torch.empty(pairs, i, dtype=x.dtype, device=x.device)  # [N*k, I]
    y = torch.empty(pairs, h, dtype=x.dtype, device=x.device)  # [N*k, H]
    block_i, block_n = columns or (_blocks(pairs), _blocks(pairs))
    common = dict(K=k, BLOCK_T=block_t, BLOCK_KP=triton.next_power_of_2(k), BY_PAIR=by_pair)
    _gate_up_kernel[(leads, triton.cdiv(i, block_i))](
        x, ids, slot_of, gate_up, host_gate_up, act, tally, n, h, i, num_experts, slots, gate_up.stride(0),
        host_gate_up.stride(0), BLOCK_I=block_i, BLOCK_H=128 if h >= 128 else 64, IS_BF16=is_bf16, IS_FP32=is_fp32,
        **common, num_warps=4 if block_i <= 32 else 8,
    )
    _down_kernel[(leads, triton.cdiv(h, block_n))](
        act, ids, slot_of, down, host_down, y, n, h, i, slots, down.stride(0), host_down.stride(0),
        BLOCK_N=block_n, BLOCK_I=128 if i >= 128 else max(16, triton.next_power_of_2(i)), IS_FP32=is_fp32, **common,
        num_warps=4 if block_n <= 32 else 8,
    )
    block = min(1024, triton.next_power_of_2(h))
    _combine_kernel[(n, triton.cdiv(h, block))](y, weights, out, h, K=k, BLOCK=block, IS_BF16=is_bf16,
                                                 num_warps=4 if block >= 512 else 1)
    return out


@triton.jit
def _probe_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs))


def host_reads_work(pinned: torch.Tensor) -> bool:
    """Whether a Triton kernel on this device can read `pinned` host memory directly (mapped pinned memory under
    unified addressing): the expert cache's misses are served that way, else they are uploaded per window."""
    if not pinned.is_pinned() or pinned.shape[-1] < 16:
        return False
    src = pinned[(0,) * (pinned.dim() - 1)][:16]  # a view of the first row (reshape would copy a strided stack)
    dst = torch.zeros(16, dtype=pinned.dtype, device="cuda")
    try:
        _probe_kernel[(1,)](src, dst, BLOCK=16)
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - Triton refuses host pointers on some setups: then the eager cache serves misses
        return False
    return bool(torch.equal(dst.cpu(), src))
