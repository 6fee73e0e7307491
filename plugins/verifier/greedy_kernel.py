"""Greedy acceptance on CUDA in two launches: torch's argmax, then one Triton program per row.

`accept.greedy_accept` in torch ops is nine launches (argmax, compare, cast, cumprod, sum,
arange, compare, full, where). On the H200 the verifier's host time was ~240 µs a cycle with
the demo pair (`benchmarks/cycle_phases.py`), paid by every cycle of every graph, target-only
included. This module is imported only on CUDA (Triton is not a CPU dependency).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _verdict_kernel(ids_ptr, drafts_ptr, accepted_ptr, emitted_ptr, K, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    col = tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + b * (K + 1) + col, mask=col < K + 1, other=-1)  # the target's argmax, K+1 positions
    drafts = tl.load(drafts_ptr + b * K + col, mask=col < K, other=-1)
    miss = (drafts != ids) | (col >= K)  # column K (the bonus) always ends the prefix
    accepted = tl.min(tl.where(miss, col, BLOCK), axis=0)
    tl.store(accepted_ptr + b, accepted.to(tl.int64))
    tl.store(emitted_ptr + b * (K + 1) + col, tl.where(col <= accepted, ids, -1), mask=col < K + 1)


def greedy_verdict(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept.greedy_accept` for CUDA tensors: accepted [B] int64, emitted [B, K+1] int64 (-1 past the bonus)."""
    # draft_tokens: [B, K] int64 (entries of -1 match no argmax); target_logits: [B, K+1, V]
    ids = target_logits.argmax(dim=-1)  # [B, K+1], contiguous
    b, k = draft_tokens.shape
    drafts = draft_tokens.contiguous()
    accepted = torch.empty(b, dtype=torch.long, device=ids.device)
    emitted = torch.empty_like(ids)
    _verdict_kernel[(b,)](ids, drafts, accepted, emitted, k, BLOCK=max(2, triton.next_power_of_2(k + 1)), num_warps=1)
    return accepted, emitted
