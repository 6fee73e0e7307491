"""A tiny Qwen3-MoE target on the device path (every expert resident: routing and fused experts with no host sync).

CPU, float32, through Triton's interpreter (TRITON_INTERPRET=1 before triton loads): the
forward and the graph runner's static windows give the expert cache's logits and greedy tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from moe_testlib import VOCAB, build_hf_moe, save_hf_moe  # noqa: E402
from numerics import assert_close_to_scale, tiny_model_bound  # noqa: E402
from target_testlib import our_greedy  # noqa: E402

from draftflow.layers.kv_cache import KVCache, static_shape  # noqa: E402
from draftflow.plugins.target.graphs import GraphRunner  # noqa: E402
from draftflow.plugins.target.hf_loader import load_hf  # noqa: E402

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
# CPU tensors through the interpreter; with CUDA, Triton compiles for the GPU and test_moe_cuda.py is the twin.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU); CUDA: test_moe_cuda.py")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_hf(save_hf_moe(build_hf_moe(seed=2), tmp_path_factory.mktemp("moe") / "hf"), "cpu", torch.float32)


def test_forward_logits_equal_the_expert_cache_path(loaded):
    """Prefill and a 4-token window: the device path's logits equal the host-routed path's (float32, to rounding)."""
    model, cfg = loaded.model, loaded.config
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    out = {}
    for device_path in (False, True):
        model.set_expert_cache(None).device_path = device_path
        cache = KVCache.growing(cfg, 1, 64, torch.float32, "cpu")
        first, _ = model(tokens[:, :8], 0, cache)
        cache.commit(8)
        second, _ = model(tokens[:, 8:], 8, cache)
        out[device_path] = torch.cat([first, second], dim=1)
    assert_close_to_scale(out[True], out[False], tiny_model_bound(2), "device-path logits")
    # hits: every MoE layer counted the distinct experts of each of the two windows on the device
    hits = model.expert_cache.counters()["expert_hits"]
    assert 2 * 2 * cfg.num_experts_per_tok <= hits <= 2 * 2 * cfg.num_experts


@pytest.mark.parametrize("resident", [None, 10])
def test_graph_runner_windows_give_the_eager_greedy_tokens(loaded, resident):
    """The runner's static one-token windows on the device path (every expert resident, or 10 of 96 with misses read
    from host memory and promoted between windows) emit the host-routed greedy continuation."""
    model, cfg = loaded.model, loaded.config
    model.set_expert_cache(None).device_path = False
    want = our_greedy(model, cfg, torch.tensor([PROMPT]), 3)
    model.set_expert_cache(None).device_path = True
    static = KVCache.from_static(torch.zeros(static_shape(cfg, 1, 64)))
    logits, _ = model(torch.tensor([PROMPT]), 0, static, logit_rows=1)  # prefill: the same at any residency
    static.commit(len(PROMPT))
    cache = model.set_expert_cache(resident)
    cache.device_path = True
    runner = GraphRunner(model, static, max_window=4, capture=False, compiled=False, min_bucket=16)
    got = [int(logits[0, -1].argmax())]
    for _ in range(2):
        logits, _ = runner(got[-1], None, static.length)
        static.commit(static.length + 1)
        got.append(int(logits[0, -1].argmax()))
    assert got == want
    if resident:
        counts = cache.counters()
        assert counts["expert_misses"] > 0 and counts["expert_upload_bytes"] > 0  # read from the host, then promoted


def test_runner_refuses_to_capture_host_routed_windows(loaded):
    """A cache whose windows need the host (host-routed, or a partly resident one's batched windows past 64 tokens)
    cannot be captured: one clear error; every expert resident on the device path can, at any batch."""
    model, cfg = loaded.model, loaded.config
    model.set_expert_cache(None).device_path = False
    static = KVCache.from_static(torch.zeros(static_shape(cfg, 8, 64)))
    with pytest.raises(ValueError, match="windows need the host"):
        GraphRunner(model, static, max_window=4, capture=True)
    model.set_expert_cache(10).device_path = True
    assert model.expert_cache.capturable(8 * 8) and not model.expert_cache.capturable(8 * 9)
    with pytest.raises(ValueError, match="windows need the host"):
        GraphRunner(model, static, max_window=9, capture=True)
    model.set_expert_cache(None).device_path = True
    assert model.expert_cache.capturable(8 * 9)
