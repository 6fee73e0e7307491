"""The Triton pieces of a DFlash block forward on CUDA: `block_rope_write` and non-causal `decode_attention`.

Run on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before triton loads), float32; with
CUDA the same tests run compiled. tests/plugins/dflash/test_dflash_block_kernels.py checks the drafter's
forward with them against its plain forward.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from draftflow.layers import triton_kernels as tk  # noqa: E402
from draftflow.layers.fused import rms  # noqa: E402
from draftflow.layers.rope import rope_tables, rotate  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QH, KVH, D = 4, 2, 16


@pytest.mark.parametrize("stale", [0, 3])
def test_block_rope_write_writes_every_live_row_at_its_position(stale):
    """C context rows (the last `stale` of them padding a graph's fixed shape) and W block rows: k/v of every live
    row normed, rotated and written at its position, the block rows' queries folded (query head h = kvh*G + g at
    row g*W + w; RoPE's tables computed in the kernel); a context row at or past the block's first position is
    never written (in a graph it lands on a block cell, which its block row writes in the same launch; here past
    the block, where a write would show)."""
    gen = torch.Generator().manual_seed(stale)
    c, w, start, capacity, eps = 6, 5, 20, 48, 1e-6
    qkv = torch.randn(1, c + w, (QH + 2 * KVH) * D, generator=gen)
    q_norm, k_norm = torch.rand(D, generator=gen) + 0.5, torch.rand(D, generator=gen) + 0.5
    live = c - stale
    block_pos = start + live + torch.arange(w)  # the block begins where the live context ends
    context_pos = torch.cat([start + torch.arange(live), block_pos[-1] + 1 + torch.arange(stale)])
    positions = torch.cat([context_pos, block_pos])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = rope_tables(inv_freq, positions, torch.float32)  # [T, 1, D]
    caches = torch.randn(2, 1, capacity, KVH, D, generator=gen)

    q, k, v = qkv.view(1, c + w, QH + 2 * KVH, D).split([QH, KVH, KVH], dim=2)
    q = rotate(rms(q, q_norm, eps), cos, sin)
    k = rotate(rms(k, k_norm, eps), cos, sin)
    want = caches.clone()
    for rows in (slice(0, live), slice(c, c + w)):  # the live context rows, the block rows
        want[0, 0, positions[rows]] = k[0, rows]
        want[1, 0, positions[rows]] = v[0, rows]
    want_q = q[0, c:].view(w, KVH, QH // KVH, D).permute(1, 2, 0, 3).reshape(1, KVH, QH // KVH * w, D)

    got = caches.clone().to(DEVICE)
    got_q = tk.block_rope_write(qkv.to(DEVICE), positions.to(DEVICE), inv_freq.to(DEVICE), q_norm.to(DEVICE),
                                k_norm.to(DEVICE), c, got[0], got[1], QH, eps)
    torch.testing.assert_close(got.cpu(), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_q.cpu(), want_q, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("start,bucket,w,span", [(37, 128, 16, None), (100, 192, 5, None), (150, 192, 16, 64),
                                                 (100, 192, 5, 16)])
def test_non_causal_decode_attention_sees_the_whole_window(start, bucket, w, span):
    """causal=False: every row of the W-row window attends keys [0, start + W), split over key blocks and merged; with
    a sliding `span`, the row at position p only keys after p - span (a sliding non-causal DFlash layer); float32 to
    1e-5."""
    gen = torch.Generator().manual_seed(start)
    g, capacity = QH // KVH, 256
    q = torch.randn(1, KVH, g * w, D, generator=gen)
    k_cache = torch.randn(1, capacity, KVH, D, generator=gen)
    v_cache = torch.randn(1, capacity, KVH, D, generator=gen)
    end = start + w
    scores = torch.einsum("hrd,shd->hrs", q[0].double(), k_cache[0, :end].double()) * D ** -0.5
    if span is not None:
        query = start + torch.arange(g * w) % w  # row r = g*W + w sits at position start + w
        scores = scores.masked_fill((query[:, None] - torch.arange(end)[None, :] >= span)[None], float("-inf"))
    out = torch.einsum("hrs,shd->hrd", torch.softmax(scores, -1), v_cache[0, :end].double())  # [KVH, G*W, D]
    want = out.view(KVH, g, w, D).permute(2, 0, 1, 3).reshape(1, w, KVH * g * D)
    got = tk.decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                              torch.tensor([start], device=DEVICE), w, bucket, causal=False, span=span)
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=1e-5)
