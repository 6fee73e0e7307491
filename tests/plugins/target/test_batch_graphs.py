"""The captured-form forward with per-row starts (what batch-bucket CUDA graphs replay) equals each row's eager B = 1 forward.

CPU runs the runner without capture (float32); the `gpu` tests capture real graphs with the
Triton prologue and split-KV attention over B rows.
"""

from __future__ import annotations

import pytest
import torch
from hybrid_testlib import build_hybrid, save
from numerics import assert_close_to_scale
from target_testlib import build_hf_model, save_hf_model

from draftflow.layers.kv_cache import KVCache, static_shape
from draftflow.layers.linear_state import LinearState
from draftflow.plugins.target.graphs import BATCH_BUCKETS, GraphRunner, batch_bucket
from draftflow.plugins.target.hf_loader import load_hf

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SLOTS, W, CAPACITY = 8, 4, 96
LENGTHS = [9, 23, 4, 40, 17, 1, 30, 12]  # committed length per slot


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-graphs")
    return {"dense": save_hf_model(build_hf_model("qwen3", seed=5), root / "dense"),
            "hybrid": save(build_hybrid(seed=2), root / "hybrid")}


def filled(loaded, device):
    """A static cache (and linear state) of SLOTS rows, slot s prefilled B = 1 with LENGTHS[s] random tokens."""
    cfg = loaded.config
    cache = KVCache.from_static(torch.zeros(static_shape(cfg, SLOTS, CAPACITY), dtype=torch.float32, device=device))
    linear = LinearState.allocate(cfg, SLOTS, W, torch.float32, device) if cfg.is_hybrid else None
    gen = torch.Generator().manual_seed(4)
    for s, n in enumerate(LENGTHS):
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(device)
        row_linear = linear.rows(s, s + 1) if linear is not None else None
        loaded.model(ids, 0, cache.rows(s, s + 1), logit_rows=0, linear=row_linear)
        cache.rows(s, s + 1).commit(n)
        if row_linear is not None:
            row_linear.commit(n)
    return cache, linear


def check_rows(loaded, device, runner_kwargs, tol):
    cfg = loaded.config
    cache, linear = filled(loaded, device)
    features = torch.zeros(SLOTS, CAPACITY, 2 * cfg.hidden_size, device=device)
    runner = GraphRunner(loaded.model, cache, W, (0, 1), linear=linear, features=features, **runner_kwargs)
    gen = torch.Generator().manual_seed(5)
    for n in (3, 5, 8, 1):  # batch buckets 4 (one pad row), 8 (three), 8, 1
        kept = cache.buffer[:, :, :, :min(LENGTHS)].clone()
        anchors = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        drafts = torch.randint(0, cfg.vocab_size, (n, W - 1), generator=gen).to(device)
        starts = LENGTHS[:n]
        logits, taps = runner.step(anchors, drafts, starts)
        logits, taps = logits.clone(), taps.clone()
        assert logits.shape == (n, W, cfg.vocab_size)
        for b in range(n):
            window = torch.cat([torch.tensor([[anchors[b]]], device=device), drafts[b:b + 1]], dim=1)
            row_linear = linear.rows(b, b + 1) if linear is not None else None
            want, want_taps = loaded.model(window, starts[b], cache.rows(b, b + 1), tap_layers=(0, 1), linear=row_linear)
            assert_close_to_scale(logits[b:b + 1], want, tol, f"n={n} row {b} logits")
            assert_close_to_scale(taps[b:b + 1], want_taps, tol, f"n={n} row {b} taps")
            assert_close_to_scale(features[b, starts[b]:starts[b] + W], want_taps[0], tol, f"n={n} row {b} features")
            assert torch.equal(logits[b].argmax(-1), want[0].argmax(-1))
        assert cache.lengths == LENGTHS and (linear is None or linear.lengths == LENGTHS)
        assert torch.equal(cache.buffer[:, :, :, :min(LENGTHS)], kept)  # committed cells are never written
    return runner


def test_batch_buckets_are_capped_by_the_slots():
    """n rows run the smallest bucket >= n, never more rows than the cache has."""
    assert BATCH_BUCKETS == (1, 2, 4, 8, 16, 32, 64)
    assert [batch_bucket(n, 64) for n in (1, 2, 3, 5, 9, 17, 33, 64)] == [1, 2, 4, 8, 16, 32, 64, 64]
    assert [batch_bucket(n, 6) for n in (3, 5, 6)] == [4, 6, 6]


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_runner_rows_equal_eager_rows_on_cpu(dirs, kind):
    """Per-row starts over a bucket, pad rows to the batch bucket: every row equals its B = 1 eager window."""
    loaded = load_hf(dirs[kind], "cpu", torch.float32)
    check_rows(loaded, "cpu", dict(capture=False, compiled=False, min_bucket=16), 1e-5)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_captured_batch_graphs_equal_eager_rows_on_cuda(dirs, kind):
    """Batch-bucket CUDA graphs (Triton prologue and split-KV attention with per-row starts) equal each row's eager window."""
    loaded = load_hf(dirs[kind], "cuda", torch.float32)
    runner = check_rows(loaded, "cuda", dict(capture=True, min_bucket=16), 1e-4)
    assert {key[0] for key in runner.graphs} == {1, 4, 8}
    if kind == "dense":
        assert runner.kernels.prologue is not None and runner.kernels.split_attention is not None
