"""One forward for prefill, decode and verify windows: positions, masking and rollback."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close_to_scale, tiny_model_bound
from target_testlib import VOCAB

from draftflow.plugins.target.hf_loader import load_hf
from draftflow.layers.kv_cache import KVCache, static_shape

BOUND = tiny_model_bound(2)  # another order of the same float32 sums; see tests/numerics.py


@pytest.fixture
def qwen3(hf_dir):
    """A loaded tiny qwen3 model (GQA 2, untied)."""
    return load_hf(hf_dir("qwen3")[1], "cpu", torch.float32)


def _tokens(n: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))  # [B, n]


def _run_in_chunks(model, cfg, tokens, sizes, cache=None):
    cache = cache or KVCache.growing(cfg, tokens.shape[0], 128, torch.float32, "cpu", chunk_tokens=8)
    outs, pos = [], 0
    for size in sizes:
        logits, _ = model(tokens[:, pos : pos + size], pos, cache)
        pos += size
        cache.commit(pos)
        outs.append(logits)
    return torch.cat(outs, dim=1), cache


def test_chunked_prefill_one_shot_and_decode_agree(qwen3):
    """Chunked prefill, one-shot prefill and token-by-token decoding give the same logits (to float32 rounding)."""
    m, cfg, tokens = qwen3.model, qwen3.config, _tokens(30)
    one_shot, _ = _run_in_chunks(m, cfg, tokens, [30])
    chunked, _ = _run_in_chunks(m, cfg, tokens, [7, 1, 12, 10])
    stepwise, _ = _run_in_chunks(m, cfg, tokens, [1] * 30)
    assert_close_to_scale(chunked, one_shot, BOUND, "chunked logits")
    assert_close_to_scale(stepwise, one_shot, BOUND, "token-by-token logits")


def test_crop_then_reforward_equals_fresh_run(qwen3):
    """After a rejected verify window, crop + a new window gives the logits of a fresh run."""
    m, cfg = qwen3.model, qwen3.config
    prefix, rejected, accepted = _tokens(12), _tokens(5, seed=1), _tokens(4, seed=2)
    _, cache = _run_in_chunks(m, cfg, prefix, [12])
    m(rejected, 12, cache)  # verify window written past the committed length
    cache.commit(17)
    cache.crop(13)  # keep one drafted token, drop the rest
    after, _ = m(accepted, 13, cache)
    fresh, _ = _run_in_chunks(m, cfg, torch.cat([prefix, rejected[:, :1], accepted], 1), [17])
    assert_close_to_scale(after, fresh[:, 13:], BOUND, "logits after the crop")


def test_logit_rows_select_rows(qwen3):
    """logit_rows as a count, a 1-D index and a per-sequence [B, R] index select the same rows as all-rows."""
    m, cfg, tokens = qwen3.model, qwen3.config, _tokens(9)
    full, taps = m(tokens, 0, KVCache.growing(cfg, 2, 16, torch.float32, "cpu"), tap_layers=(0,))
    assert full.shape == (2, 9, VOCAB) and full.dtype == torch.float32
    assert taps.shape == (2, 9, cfg.hidden_size)
    last3, _ = m(tokens, 0, KVCache.growing(cfg, 2, 16, torch.float32, "cpu"), logit_rows=3)
    assert_close_to_scale(last3, full[:, -3:], BOUND, "last 3 rows")
    rows, _ = m(tokens, 0, KVCache.growing(cfg, 2, 16, torch.float32, "cpu"), logit_rows=torch.tensor([0, 4]))
    assert_close_to_scale(rows, full[:, [0, 4]], BOUND, "rows 0 and 4")
    per_seq = torch.tensor([[1, 2], [8, 0]])
    rows, _ = m(tokens, 0, KVCache.growing(cfg, 2, 16, torch.float32, "cpu"), logit_rows=per_seq)
    assert_close_to_scale(rows, torch.stack([full[0, [1, 2]], full[1, [8, 0]]]), BOUND, "per-sequence rows")


def test_static_cache_matches_growing_cache(qwen3):
    """A static cache over one preallocated buffer gives the same logits as a growing one."""
    m, cfg, tokens = qwen3.model, qwen3.config, _tokens(20)
    buffer = torch.zeros(static_shape(cfg, 2, 24))
    static, _ = _run_in_chunks(m, cfg, tokens, [11, 9], cache=KVCache.from_static(buffer))
    grown, _ = _run_in_chunks(m, cfg, tokens, [11, 9])
    assert_close_to_scale(static, grown, BOUND, "static-cache logits")
    assert buffer.abs().sum() > 0  # the caller's buffer is the storage, not a copy


def test_forward_past_committed_length_is_refused(qwen3):
    """A window starting after the committed length would read unwritten cells, so it raises."""
    m, cfg = qwen3.model, qwen3.config
    cache = KVCache.growing(cfg, 2, 32, torch.float32, "cpu")
    m(_tokens(4), 0, cache)
    with pytest.raises(ValueError, match=r"start_pos=4 but the KV cache holds only 0 committed"):
        m(_tokens(2), 4, cache)


def test_bad_tap_layer_is_refused(qwen3):
    """A tap layer outside the model raises naming the layer."""
    cache = KVCache.growing(qwen3.config, 2, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"tap_layers \[2\] are outside \[0, 2\)"):
        qwen3.model(_tokens(4), 0, cache, tap_layers=(0, 2))
