"""The split-over-key-blocks decode attention (triton_kernels.decode_attention) and the merge of its key blocks.

Run on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before triton loads), float32;
with CUDA the same test runs compiled, and tests/plugins/target/test_graph_step.py checks it inside
captured models against the eager forward.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from draftflow.layers import triton_kernels as tk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(q, k_cache, v_cache, starts, w):
    """Row r = g*W + w of KV head h at batch b attends keys [0, start_b + w]: [B, W, KVH*G*D]."""
    b, kvh, rows, d = q.shape
    g = rows // w
    out = torch.empty(b, w, kvh, g, d, dtype=torch.float64)
    for bi in range(b):
        for h in range(kvh):
            for r in range(rows):
                end = int(starts[bi]) + r % w + 1
                scores = (k_cache[bi, :end, h].double() @ q[bi, h, r].double()) * d ** -0.5
                out[bi, r % w, h, r // w] = torch.softmax(scores, 0) @ v_cache[bi, :end, h].double()
    return out.reshape(b, w, kvh * g * d)


@pytest.mark.parametrize("starts,bucket,w", [([100, 37], 192, 3), ([5, 5], 64, 3), ([500, 37], 576, 3), ([100, 37], 192, 9),
                                                    ([300, 41], 384, 16)])
def test_decode_attention_merges_its_key_blocks(starts, bucket, w):
    """Per-row window starts, several key blocks (some past a row's window) or one, windows of 3, 9 and 16 tokens
    (float32 windows past 16 rows split their rows over programs):
    softmax attention over each row's visible prefix after the combine kernel's merge, float32 to 1e-5."""
    gen = torch.Generator().manual_seed(bucket)
    b, kvh, g, d, capacity = 2, 2, 2, 16, 640
    q = torch.randn(b, kvh, g * w, d, generator=gen).to(DEVICE)
    k_cache = torch.randn(b, capacity, kvh, d, generator=gen).to(DEVICE)
    v_cache = torch.randn(b, capacity, kvh, d, generator=gen).to(DEVICE)
    start = torch.tensor(starts, dtype=torch.long, device=DEVICE)
    got = tk.decode_attention(q, k_cache, v_cache, start, w, bucket)
    want = _reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), starts, w)
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=1e-5)
