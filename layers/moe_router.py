"""Routing on the device for the MoE device path: the router's top-k, alone or fused with the router's GEMV.

- `route_topk(logits, k, norm, dtype)`: softmax in float32, top-k (ties: the lowest expert id),
  optional renormalisation, cast to the activation dtype: the order of `moe.route`, one
  program per token; expert ids stay on the device.
- `router_topk(x, weight, k, norm)`: the router's GEMV and that routing in one launch, for
  windows of <= ROUTER_MAX_TOKENS tokens.
- `add_rms_route(x, delta, norm_weight, eps, offset, weight, k, norm)`: also the residual add
  and post-attention RMSNorm before the router (the graph runner's path for a MoE layer).

Imported only on CUDA paths, or by tests through Triton's interpreter (TRITON_INTERPRET=1)
on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftflow.layers.triton_kernels import round_like, add_rms_row, arrival_counters, pdl, pdl_enter


@triton.jit
def _store_top_k(x, live, cols, w_ptr, ids_ptr, t, K: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, store):
    # One token's routing from its float32 logits x [BLOCK_E] (live: real experts): softmax, top-k (ties: the lowest
    # expert id), optional renormalisation; weights [K] (w_ptr's dtype) and ids [K] int64 stored at row t, largest
    # first, where `store` (a [BLOCK_K] mask) holds. Each pick is one max over int64 keys: a probability's float32
    # bits (non-negative, so ordered as integers) above the complement of its expert id (the lower id wins a tie)
    p = tl.where(live, tl.exp(x - tl.max(x, 0)), 0.0)
    probs = p / tl.sum(p, 0)
    low = 65535 - cols.to(tl.int64)  # experts < 2^16
    keys = tl.where(live, (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | low, -1)
    ks = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for kk in tl.static_range(K):
        best = tl.max(keys, 0)
        top_w = tl.where(ks == kk, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), top_w)
        top_i = tl.where(ks == kk, (65535 - (best & 0xFFFFFFFF)).to(tl.int32), top_i)
        keys = tl.where(keys == best, -1, keys)
    if NORM:
        top_w = top_w / tl.sum(tl.where(ks < K, top_w, 0.0), 0)
    tl.store(w_ptr + t * K + ks, top_w.to(w_ptr.dtype.element_ty), mask=store & (ks < K))
    tl.store(ids_ptr + t * K + ks, top_i.to(tl.int64), mask=store & (ks < K))


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  NORM: tl.constexpr):
    # One program per token: logits [N, E] -> weights [N, K] (w_ptr's dtype), ids [N, K] int64, largest first
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    live = cols < E
    x = tl.load(logits_ptr + t * E + cols, mask=live, other=float("-inf")).to(tl.float32)
    _store_top_k(x, live, cols, w_ptr, ids_ptr, t, K, BLOCK_K, NORM, tl.arange(0, BLOCK_K) >= 0)


def route_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route` in one launch: (weights [N, k] in dtype, expert ids [N, k] int64)."""
    # logits: [N, E], contiguous rows
    n, e = logits.shape
    if e >= 1 << 16:
        raise ValueError(f"route_topk takes fewer than 65536 experts, not {e}")
    logits = logits.contiguous()
    weights = torch.empty(n, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(n, top_k, dtype=torch.long, device=logits.device)
    if n:
        _route_kernel[(n,)](logits, weights, ids, e, K=top_k, BLOCK_E=triton.next_power_of_2(e),
                            BLOCK_K=triton.next_power_of_2(top_k), NORM=norm_topk_prob, num_warps=4 if e >= 256 else 1)
    return weights, ids


# ---- The router GEMV and routing in one launch (decode and verify windows) ----
# At one token the router's GEMV (E x H, 0.5 MB at the 30B shape) is a latency-bound cuBLAS launch of about 5 us, and
# route_topk a second launch. Here programs (token t, block of experts) each compute their logits (float32 sums,
# rounded to the activation dtype as the GEMV's output is) into a float32 scratch row, then take token t's arrival
# counter; the last program to arrive routes the token from the whole row (the same softmax / top-k code as
# route_topk) and resets the counter. `add_rms_route` also folds in the residual add and the post-attention RMSNorm
# before it (each program normalises the row itself; the first expert block stores the sum and the normed row), so
# a MoE layer's FFN input costs one launch.
ROUTER_MAX_TOKENS = 64  # windows up to this many tokens take the fused router (verify windows; prefill does not)
ROUTER_PROGRAMS = 64  # programs per token (expert blocks): each loads its rows of the router in one or few steps
ROUTER_TILE = 8192  # most router weights a program holds per step (expert rows x BLOCK_H)
ROUTER_WARPS = 4


@triton.jit
def _router_kernel(x_ptr, d_ptr, nw_ptr, sum_ptr, normed_ptr, gw_ptr, logit_ptr, w_ptr, ids_ptr, count_ptr, H, E, eps,
                   K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ALL: tl.constexpr,
                   BLOCK_K: tl.constexpr, NORM: tl.constexpr, IS_BF16: tl.constexpr, ADD_RMS: tl.constexpr,
                   OFFSET: tl.constexpr, PDL: tl.constexpr = False):
    # x: [N, H]; gw: [E, H] (the router's weight, x's dtype); logit: [N, E] float32 scratch; count: [N] zeros.
    # ADD_RMS (BLOCK_H >= H): the router's input is RMSNorm(x + d) with weight nw; sum and normed [N, H] are stored.
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    eb = tl.program_id(1)
    rows = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    row_live = rows < E
    hs = tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    if ADD_RMS:
        h_live = hs < H
        s, xv = add_rms_row(x_ptr + t * H, d_ptr + t * H, nw_ptr, hs, h_live, H, eps, True, OFFSET, IS_BF16)
        first = (hs * 0 + eb) == 0
        tl.store(sum_ptr + t * H + hs, s.to(sum_ptr.dtype.element_ty), mask=h_live & first)
        tl.store(normed_ptr + t * H + hs, xv.to(normed_ptr.dtype.element_ty), mask=h_live & first)
        xv = round_like(xv, IS_BF16)  # the router reads the row as stored (float32 and bf16 rows only)
        w = tl.load(gw_ptr + rows[:, None].to(tl.int64) * H + hs[None, :], mask=row_live[:, None] & h_live[None, :],
                    other=0.0).to(tl.float32)
        acc += w * xv[None, :]
    else:
        for h0 in range(0, H, BLOCK_H):
            h = h0 + hs
            h_live = h < H
            xv = tl.load(x_ptr + t * H + h, mask=h_live, other=0.0).to(tl.float32)
            w = tl.load(gw_ptr + rows[:, None].to(tl.int64) * H + h[None, :],
                        mask=row_live[:, None] & h_live[None, :], other=0.0).to(tl.float32)
            acc += w * xv[None, :]
    logits = round_like(tl.sum(acc, 1), IS_BF16)  # [BLOCK_E]: the GEMV's output in the activation dtype
    tl.store(logit_ptr + t * E + rows, logits, mask=row_live)
    tl.debug_barrier()  # every thread's logits are written before the release below
    done = tl.atomic_add(count_ptr + t, 1, sem="acq_rel") + 1
    cols = tl.arange(0, BLOCK_ALL)
    last = (cols * 0 + done) == tl.num_programs(1)  # [BLOCK_ALL]: this program routes the token
    live = cols < E
    x = tl.load(logit_ptr + t * E + cols, mask=live & last, other=0.0, cache_modifier=".cg")
    x = tl.where(live, x, float("-inf"))
    _store_top_k(x, live, cols, w_ptr, ids_ptr, t, K, BLOCK_K, NORM, tl.arange(0, BLOCK_K) * 0 + done == tl.num_programs(1))
    if done == tl.num_programs(1):
        tl.store(count_ptr + t, 0)  # ready for the next launch (or graph replay)


def router_fits(x: torch.Tensor, gate: torch.nn.Module) -> bool:
    """Whether `router_topk` / `add_rms_route` take this window: <= ROUTER_MAX_TOKENS rows, bf16 or float32, a
    bias-free router in the activations' dtype (a quantized or float32 router in a bf16 model keeps the GEMV +
    route_topk pair)."""
    weight = getattr(gate, "weight", None)
    rows = x.numel() // x.shape[-1]
    return (type(gate) is torch.nn.Linear and gate.bias is None and x.dtype in (torch.bfloat16, torch.float32)
            and weight.dtype == x.dtype and rows <= ROUTER_MAX_TOKENS and weight.is_contiguous()
            and weight.shape[0] < 1 << 16)


def _route_launch(x, weight, top_k, norm_topk_prob, add_rms=None):
    n, h = x.numel() // x.shape[-1], x.shape[-1]
    e = weight.shape[0]
    weights = torch.empty(n, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(n, top_k, dtype=torch.long, device=x.device)
    whole = triton.next_power_of_2(h)
    block_e = max(2, triton.next_power_of_2(triton.cdiv(e, ROUTER_PROGRAMS)))
    if add_rms is not None:
        block_e = max(1, min(block_e, ROUTER_TILE // whole))  # the whole row in one step
        delta, norm_weight, eps, offset, total, normed = add_rms
    else:
        delta = norm_weight = total = normed = x
        eps, offset = 0.0, False
    if n:
        logits = torch.empty(n, e, dtype=torch.float32, device=x.device)
        _router_kernel[(n, triton.cdiv(e, block_e))](
            x, delta, norm_weight, total, normed, weight, logits, weights, ids, arrival_counters(x.device), h, e, eps,
            K=top_k, BLOCK_E=block_e, BLOCK_H=whole if add_rms is not None else max(16, min(ROUTER_TILE // block_e, whole)),
            BLOCK_ALL=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k), NORM=norm_topk_prob,
            IS_BF16=x.dtype == torch.bfloat16, ADD_RMS=add_rms is not None, OFFSET=offset, num_warps=ROUTER_WARPS,
            **pdl(x.device))
    return weights, ids


def router_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk(F.linear(x, weight), ...)` in one launch: (weights [N, k] in x.dtype, expert ids [N, k] int64)."""
    # x: [N, H]; weight: [E, H]
    return _route_launch(x.contiguous(), weight, top_k, norm_topk_prob)


def add_rms_route(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float, offset: bool,
                  weight: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """`triton_kernels.add_rms(x, delta, norm_weight, ...)` and `router_topk` of its normed rows, in one launch:
    (x + delta, RMSNorm of it, (weights [N, k], expert ids [N, k])). x, delta: contiguous [..., H]."""
    total, normed = torch.empty_like(x), torch.empty_like(x)
    routing = _route_launch(x, weight, top_k, norm_topk_prob, (delta, norm_weight, eps, offset, total, normed))
    return total, normed, routing
