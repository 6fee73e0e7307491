"""Attention over a cache prefix, and the device-side metadata of a forward window.

A window of T tokens writes K/V at its positions and attends to the first `keys` cache
cells, later ones masked. Eager forwards (prefill chunks, CPU, training) know the start
on the host and read the exact prefix (`keys = start + T`); captured forwards hold the
start in a device tensor and read a fixed prefix, a *bucket* (`bucket_for`), so shapes
depend only on (T, bucket) and one CUDA graph per pair serves every cycle. `Window`
carries both forms; the same layer code runs either way. In a batch each row may start
at its own position (positions [B, T]): keys are the longest row's prefix and each row
masks the cells past its own positions.

Backends: `attend` is SDPA (the plain kernel when no mask is needed, else the
memory-efficient kernel with the query groups folded into rows, `attend_prefix`);
`draftflow.layers.triton_kernels.decode_attention` is the split-KV Triton backend.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MIN_BUCKET = 256  # smallest attention prefix; shorter buckets save nothing measurable at batch 1
# Flash takes no mask; pin the masked kernel so a captured graph does not depend on torch's heuristics.
BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# `enable_gqa` lets SDPA broadcast KV heads without materialising repeated K/V (torch >= 2.5).
_NATIVE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def bucket_for(end: int, capacity: int, smallest: int = MIN_BUCKET) -> int:
    """Cache prefix attended by a window ending at `end`: the smallest power of two >= end (and >= `smallest`), capped at `capacity`."""
    size = max(smallest, 1)
    while size < end:
        size *= 2
    return min(size, capacity)


class Window:
    """Where a window's tokens go and which cache cells they see, as device tensors.

    `positions` is [T] when every row of the batch starts at the same position (B = 1, a
    prefill chunk) or [B, T] with per-row starts (a batched step: row b at start_b ..
    start_b + T - 1); `start` is [1] or [B] to match. `keys` is the attended prefix length
    (eager: the largest end over the rows; captured: a bucket). `host_start` is the start
    when the host knows one start for all rows (eager forwards: K/V are written by slicing,
    which a training cache without a buffer also supports), else None (K/V written at
    `positions` on the device: `index_copy_`, or `index_put_` per row). `causal`: no mask
    is needed (an exact prefix from position 0, or one token over an exact prefix).
    """

    def __init__(self, positions: torch.Tensor, start: torch.Tensor, keys: int, host_start: int | None,
                 causal: bool) -> None:
        # positions: [T] or [B, T] int64; start: [1] or [B] int64
        self.positions, self.start, self.keys = positions, start, keys
        self.host_start, self.causal = host_start, causal
        self._masks: dict = {}

    @property
    def per_row(self) -> bool:
        """True when rows start at different positions (positions [B, T])."""
        return self.positions.dim() == 2

    @classmethod
    def at(cls, start_pos: int, t: int, device: torch.device | str, causal: bool | None = None) -> Window:
        """An eager window at host position `start_pos` over the exact prefix [0, start_pos + t)."""
        positions = torch.arange(start_pos, start_pos + t, device=device)  # [T]
        causal = (start_pos == 0 or t == 1) if causal is None else causal
        return cls(positions, positions[:1], start_pos + t, start_pos, causal)

    @classmethod
    def rows(cls, starts: list[int], t: int, device: torch.device | str) -> Window:
        """An eager window with row b at host position `starts[b]`, over the prefix [0, max(starts) + t)."""
        if len(set(starts)) == 1:
            return cls.at(starts[0], t, device)
        start = torch.tensor(starts, dtype=torch.long, device=device)  # [B]
        positions = start[:, None] + torch.arange(t, device=device)  # [B, T]
        return cls(positions, start, max(starts) + t, None, False)

    @classmethod
    def bucketed(cls, start: torch.Tensor, t: int, bucket: int) -> Window:
        """A window at the device-held `start` ([1], or [B] per row) over the first `bucket` cache cells (static shapes)."""
        steps = torch.arange(t, device=start.device)
        positions = start + steps if start.shape[0] == 1 else start[:, None] + steps  # [T] or [B, T]
        return cls(positions, start, bucket, None, False)

    def folded_mask(self, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask, query row g*T + j sees keys <= its position (stale cells past it get -inf):
        [G*T, keys], or [B, 1, G*T, keys] for per-row positions."""
        key = (groups, dtype)
        if key not in self._masks:  # once per forward, shared by every layer
            visible = torch.arange(self.keys, device=self.positions.device) <= self.positions[..., None]  # [(B,) T, keys]
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
            if self.per_row:
                self._masks[key] = mask.repeat(1, groups, 1)[:, None]
            else:
                self._masks[key] = mask.repeat(groups, 1)
        return self._masks[key]

    def write(self, cache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the window's keys and values in one cache layer at its positions."""
        # k, v: [B, T, KVH, D]
        if self.host_start is not None:
            cache.write(layer, self.host_start, k, v)
        elif self.per_row:
            if "rows" not in self._masks:
                self._masks["rows"] = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
            index = (self._masks["rows"], self.positions)
            cache.buffer[layer, 0].index_put_(index, k)
            cache.buffer[layer, 1].index_put_(index, v)
        else:
            cache.buffer[layer, 0].index_copy_(1, self.positions, k)
            cache.buffer[layer, 1].index_copy_(1, self.positions, v)


def _without_cudnn(q: torch.Tensor):
    """SDPA's backends as enabled around this call, less cuDNN's, for a CUDA query: cuDNN's attention builds a graph
    for every new shape (H200, bfloat16: ~6 ms a call, ~54 ms of a demo prefill at each new prompt length, profiled
    in docs/BENCHMARKS.md), where flash and the memory-efficient kernel have no per-shape cost."""
    cuda = torch.backends.cuda
    if not (q.is_cuda and cuda.cudnn_sdp_enabled()):
        return nullcontext()
    return sdpa_kernel([b for b, on in ((SDPBackend.FLASH_ATTENTION, cuda.flash_sdp_enabled()),
                                        (SDPBackend.EFFICIENT_ATTENTION, cuda.mem_efficient_sdp_enabled()),
                                        (SDPBackend.MATH, cuda.math_sdp_enabled())) if on])


def fold(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Queries with each KV head's group folded into rows: [B, T, QH, D] -> [B, KVH, G*T, D], row g*T + j."""
    b, t, qh, d = q.shape
    return q.transpose(1, 2).reshape(b, num_kv_heads, qh // num_kv_heads * t, d)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: Window) -> torch.Tensor:
    """SDPA over a cache prefix: the plain (flash-eligible, causal) kernel when no mask is needed, else the masked one."""
    # q: [B, KVH, G*T, D] folded; keys, values: [B, S, KVH, D] (cache views) -> [B, T, QH*D]
    b, kvh, rows, d = q.shape
    t = window.positions.shape[-1]
    if not window.causal:
        return attend_prefix(q, keys, values, window.folded_mask(rows // t, q.dtype), t)
    with _without_cudnn(q):
        return _attend_causal(q, keys, values, t)


def _attend_causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, t: int) -> torch.Tensor:
    b, kvh, rows, d = q.shape
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, KVH, S, D]
    if t == 1:  # one query over its exact prefix: each KV head's G query heads are G rows over its keys, no mask and
        # no repeated K/V (float32 on CUDA repeated the prefix's K/V every step, e.g. regenerating training windows)
        return F.scaled_dot_product_attention(q, keys, values).reshape(b, 1, kvh * rows * d)  # from [B, KVH, G, D]
    q = q.view(b, rows // t * kvh, t, d)  # [B, QH, T, D]: head h = kvh*G + g
    if _NATIVE_GQA and not (q.is_cuda and q.dtype == torch.float32):
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=rows // t > 1)
    else:  # float32 on CUDA: flash cannot run it, and `enable_gqa` keeps the memory-efficient kernel out, so SDPA
        # fell back to its math path (H200: ~0.64 ms of host time a layer of a prefill); repeated heads keep it in
        rep = rows // t
        out = F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
                                             is_causal=True)
    return out.transpose(1, 2).reshape(b, t, -1)


def attend_prefix(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, w: int) -> torch.Tensor:
    """Masked attention over a cache prefix, each KV head's query group folded into the query rows.

    Folding (rather than `enable_gqa`) keeps the call eligible for the memory-efficient
    kernel, the one that takes a mask. At batch 1 each KV head becomes a batch entry, so a
    one-token window's output is already in o_proj's [heads * D] order (no copy).
    """
    # q: [B, KVH, G*W, D]; keys, values: [B, S, KVH, D] (cache views); mask: [G*W, S] or [B, 1, G*W, S]
    # -> [B, W, QH*D]
    with _without_cudnn(q):
        return _attend_masked(q, keys, values, mask, w)


def _attend_masked(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   w: int) -> torch.Tensor:
    b, kvh, rows, d = q.shape
    g = rows // w
    if b == 1:
        out = F.scaled_dot_product_attention(q.view(kvh, 1, rows, d), keys.permute(2, 0, 1, 3),
                                             values.permute(2, 0, 1, 3), attn_mask=mask)  # [KVH, 1, G*W, D]
        return out.view(kvh, g, w, d).permute(2, 0, 1, 3).reshape(1, w, kvh * g * d)
    out = F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask)
    return out.view(b, kvh, g, w, d).permute(0, 3, 1, 2, 4).reshape(b, w, kvh * g * d)
