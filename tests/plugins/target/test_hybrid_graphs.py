"""A hybrid (Qwen3-Next) target through the graph runner: the same forward with a device-held start, exact.

The CPU test runs the runner without capture; the `gpu` tests capture real CUDA graphs
(Gated DeltaNet windows, gated attention, partial rotary, (1 + w) norms inside them).
"""

from __future__ import annotations

import pytest
import torch
from hybrid_testlib import VOCAB, build_hybrid, save
from numerics import assert_close_to_scale

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import GraphSpec
from draftflow.layers.kv_cache import KVCache, static_shape
from draftflow.layers.linear_state import LinearState
from draftflow.plugins.target.graphs import GraphRunner
from draftflow.plugins.target.hf_loader import load_hf

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPT = [5, 17, 42, 9, 100, 3, 77, 12, 250]
# (window length, tokens kept): decode steps and verify windows, some rejected.
WINDOWS = [(1, 1), (5, 2), (1, 1), (3, 3), (4, 1), (5, 5), (2, 1), (1, 1)]
MAX_WINDOW = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save(build_hybrid(seed=3, head_scale=4.0), tmp_path_factory.mktemp("hybrid") / "m")


def _compare(loaded, device: str, runner_kwargs: dict, mode: str, tol: float) -> GraphRunner:
    """Prefill two (cache, linear state) pairs eagerly; run WINDOWS through the eager forward and the runner side by side."""
    cfg = loaded.config
    pairs = []
    for _ in range(2):
        cache = KVCache.from_static(torch.zeros(static_shape(cfg, 1, 64), device=device))
        linear = LinearState.allocate(cfg, 1, MAX_WINDOW, torch.float32, device, mode)
        with torch.inference_mode():
            loaded.model(torch.tensor([PROMPT], device=device), 0, cache, logit_rows=1, linear=linear)
        cache.commit(len(PROMPT))
        linear.commit(len(PROMPT))
        pairs.append((cache, linear))
    (eager, eager_linear), (static, static_linear) = pairs
    runner = GraphRunner(loaded.model, static, MAX_WINDOW, (0, 1), linear=static_linear, **runner_kwargs)
    gen = torch.Generator().manual_seed(0)
    for step, (w, kept) in enumerate(WINDOWS):
        start = eager.length
        window = torch.randint(0, VOCAB, (1, w), generator=gen).to(device)
        with torch.inference_mode():
            want, want_taps = loaded.model(window, start, eager, tap_layers=(0, 1), linear=eager_linear)
            got, got_taps = runner(int(window[0, 0]), window[:, 1:] if w > 1 else None, start)
        assert_close_to_scale(got, want, tol, f"window {step}: logits")
        assert_close_to_scale(got_taps, want_taps, tol, f"window {step}: taps")
        for cache, linear in pairs:
            cache.commit(start + kept)
            linear.commit(start + kept)
        assert_close_to_scale(static_linear.rec[:, 0], eager_linear.rec[:, 0], tol, f"window {step}: recurrent state")
    return runner


@pytest.mark.parametrize("mode", ["select", "replay"])
def test_hybrid_runner_without_capture_equals_eager_forward(model_dir, mode):
    """On the CPU, the runner's forward (device-held start, bucketed attention) equals the eager forward in float32."""
    loaded = load_hf(model_dir, "cpu", torch.float32)
    _compare(loaded, "cpu", dict(capture=False, compiled=False, min_bucket=16), mode, 1e-5)


def test_hybrid_runner_refuses_a_missing_linear_state(model_dir):
    """A hybrid target's runner needs the linear state the windows update."""
    loaded = load_hf(model_dir, "cpu", torch.float32)
    cache = KVCache.from_static(torch.zeros(static_shape(loaded.config, 1, 32)))
    with pytest.raises(ValueError, match="needs its LinearState"):
        GraphRunner(loaded.model, cache, 4, capture=False, compiled=False)


def _generate(path, oracle=None, cuda_graphs=True, n=40):
    nodes = {"target": {"plugin": "target", "params": {"path": str(path), "cuda_graphs": cuda_graphs}},
             "verify": {"plugin": "verifier"}}
    if oracle is not None:
        nodes["oracle"] = {"plugin": "oracle", "params": oracle}
    spec = GraphSpec.from_dict({"device": "cuda", "dtype": "float32", "num_draft": 4, "max_context": 128, "nodes": nodes})
    plan = build_plan(spec, load_registry(autoload=False))
    plan.raise_if_problems()
    ex = Executor(plan)
    ex.warmup()
    runner = ex.nodes["target"].runner
    warm = set(runner.graphs) if runner is not None else set()
    result = ex.generate(PROMPT, SamplingParams(max_new_tokens=n, ignore_eos=True))
    if runner is not None:  # warm-up captured the decode and full verify windows and the padded widths between
        # (graph_widths(5): 2 and 4) in every bucket up to warmup_tokens, so the request captured none
        assert {(b, w) for b, w, _ in warm} == {(1, 1), (1, 2), (1, 4), (1, 5)} and warm <= set(runner.graphs)
        buckets = {bucket for _, _, bucket in warm}
        assert warm == {(1, w, bucket) for w in (1, 2, 4, 5) for bucket in buckets}
        assert oracle is not None or set(runner.graphs) == warm
    return ex, result


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_captured_hybrid_windows_match_eager_on_cuda(model_dir, compiled):
    """Replayed CUDA graphs of a hybrid target give the eager forward's logits, taps and states (float32)."""
    loaded = load_hf(model_dir, "cuda", torch.float32)
    runner = _compare(loaded, "cuda", dict(capture=True, compiled=compiled, min_bucket=8), "select", 1e-4)
    assert len(runner.graphs) >= 3  # captured, not run eagerly


@needs_cuda
@pytest.mark.gpu
def test_hybrid_greedy_generate_through_graphs_equals_eager_on_cuda(model_dir):
    """Greedy decoding with cuda_graphs on equals cuda_graphs off token for token: target-only and with rejected drafts."""
    _, reference = _generate(model_dir, cuda_graphs=False)
    ex, plain = _generate(model_dir)
    assert ex.nodes["target"].runner is not None
    assert plain.token_ids == reference.token_ids
    oracle = {"reference": list(reference.token_ids), "errors": [3, 9, 10, 21]}
    _, drafted = _generate(model_dir, oracle=oracle)
    assert drafted.token_ids == reference.token_ids
    assert drafted.stats["drafted"] > 0
