"""KVCache modes, growth and bounds."""

from __future__ import annotations

import pytest
import torch

from draftflow.layers.config import TargetConfig, kv_bytes_per_token
from draftflow.core.errors import CacheCapacityError
from draftflow.layers.kv_cache import KVCache, static_shape

HF_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
}


@pytest.fixture
def cfg() -> TargetConfig:
    return TargetConfig.from_hf_dict(HF_CONFIG, "config.json")


def test_static_shape_and_bytes_agree(cfg):
    """static_shape is [L, 2, B, capacity, KVH, D] and its size matches kv_bytes_per_token."""
    shape = static_shape(cfg, 2, 10)
    assert shape == (3, 2, 2, 10, 2, 8)
    assert torch.empty(shape, dtype=torch.bfloat16).nbytes == 2 * 10 * kv_bytes_per_token(cfg, torch.bfloat16)


def test_grow_mode_allocates_in_chunks_and_keeps_contents(cfg):
    """A growing cache rounds up to whole chunks, keeps written cells, and stops at max_tokens."""
    cache = KVCache.growing(cfg, 1, max_tokens=40, dtype=torch.float32, device="cpu", chunk_tokens=16)
    assert cache.mode == "grow" and cache.capacity == 0
    cache.ensure(5)
    assert cache.capacity == 16
    k = torch.randn(1, 5, 2, 8)
    cache.write(1, 0, k, -k)
    cache.ensure(33)
    assert cache.capacity == 40  # capped at max_tokens, not 48
    keys, values = cache.read(1, 5)
    assert torch.equal(keys, k) and torch.equal(values, -k)
    with pytest.raises(CacheCapacityError, match=r"needs 41 positions but holds at most 40"):
        cache.ensure(41)


def test_static_mode_never_grows(cfg):
    """A static cache refuses to pass its buffer's capacity."""
    cache = KVCache.from_static(torch.zeros(static_shape(cfg, 1, 8)))
    cache.ensure(8)
    with pytest.raises(CacheCapacityError, match=r"KV cache \(static\) needs 9 positions"):
        cache.ensure(9)


def test_commit_and_crop_bounds(cfg):
    """commit sets the length within capacity; crop only shortens."""
    cache = KVCache.from_static(torch.zeros(static_shape(cfg, 1, 8)))
    cache.commit(6)
    cache.crop(2)
    assert cache.length == 2
    with pytest.raises(CacheCapacityError, match=r"crop\(5\) is outside \[0, 2\]"):
        cache.crop(5)
    with pytest.raises(CacheCapacityError, match=r"commit\(9\) is outside \[0, 8\]"):
        cache.commit(9)


def test_static_buffer_of_wrong_rank_is_refused():
    """Wrapping a buffer that is not [L, 2, B, capacity, KVH, D] raises with the fix."""
    with pytest.raises(CacheCapacityError, match=r"allocate it with static_shape"):
        KVCache.from_static(torch.zeros(3, 2, 8))
