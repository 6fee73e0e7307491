"""Attention over a fixed cache prefix (a *bucket*), the form every captured forward uses.

A window's queries attend to the first `bucket` cache cells with later keys masked, so
shapes depend only on (window, bucket) and one CUDA graph per pair serves every cycle.
`attend_prefix` is the SDPA backend (the memory-efficient kernel takes the mask);
`draftflow.layers.triton_kernels.decode_attention` is the split-KV Triton backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

MIN_BUCKET = 256  # smallest attention prefix; shorter buckets save nothing measurable at batch 1
# Flash takes no mask; pin the masked kernel so a captured graph does not depend on torch's heuristics.
BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def bucket_for(end: int, capacity: int, smallest: int = MIN_BUCKET) -> int:
    """Cache prefix attended by a window ending at `end`: the smallest power of two >= end (and >= `smallest`), capped at `capacity`."""
    size = max(smallest, 1)
    while size < end:
        size *= 2
    return min(size, capacity)


def attend_prefix(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, w: int) -> torch.Tensor:
    """Masked attention over a cache prefix, each KV head's query group folded into the query rows.

    Folding (rather than `enable_gqa`) keeps the call eligible for the memory-efficient
    kernel, the one that takes a mask. At batch 1 each KV head becomes a batch entry, so a
    one-token window's output is already in o_proj's [heads * D] order (no copy).
    """
    # q: [B, KVH, G*W, D]; keys, values: [B, S, KVH, D] (cache views); mask: [G*W, S] -> [B, W, QH*D]
    b, kvh, rows, d = q.shape
    g = rows // w
    if b == 1:
        out = F.scaled_dot_product_attention(q.view(kvh, 1, rows, d), keys.permute(2, 0, 1, 3),
                                             values.permute(2, 0, 1, 3), attn_mask=mask)  # [KVH, 1, G*W, D]
        return out.view(kvh, g, w, d).permute(2, 0, 1, 3).reshape(1, w, kvh * g * d)
    out = F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask)
    return out.view(b, kvh, g, w, d).permute(0, 3, 1, 2, 4).reshape(b, w, kvh * g * d)
