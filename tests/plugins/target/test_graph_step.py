"""The forward with a device-held start over a bucket (what CUDA graphs replay) computes what the eager forward computes.

CPU tests run the step without capture (float32, 1e-5); the `gpu` tests capture real
graphs (torch.compile included) and run only where CUDA is available.
"""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close_to_scale, reduction_bound, tiny_model_bound
from target_testlib import VOCAB

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import GraphSpec
from draftflow.layers.attention import bucket_for
from draftflow.layers.fused import fuse_projections, joined
from draftflow.plugins.target.graphs import GraphRunner, graph_width, graph_widths
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.layers.kv_cache import KVCache, static_shape

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32]
# (window length, tokens kept): decode steps and verify windows, some rejected so stale cells sit past the length.
WINDOWS = [(1, 1), (5, 2), (1, 1), (3, 3), (4, 1), (8, 8), (1, 1)]


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))  # [1, n]


def _close(got, want, tol, rel):
    if rel:  # bf16: compare as METHOD.md does, by relative norm
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < tol, f"relative error {err:.2e} >= {tol}"
    else:
        assert_close_to_scale(got, want, tol)


def _compare(model, cfg, device, dtype, runner_kwargs, capacity=64, taps=(), tol=tiny_model_bound(2), prompt=PROMPT,
             rel=False):
    """Prefill both caches eagerly, then run WINDOWS through the eager forward and the runner side by side."""
    eager = KVCache.from_static(torch.zeros(static_shape(cfg, 1, capacity), dtype=dtype, device=device))
    static = KVCache.from_static(torch.zeros(static_shape(cfg, 1, capacity), dtype=dtype, device=device))
    for cache in (eager, static):
        model(torch.tensor([prompt], device=device), 0, cache)
        cache.commit(len(prompt))
    runner = GraphRunner(model, static, max_window=8, tap_layers=taps, **runner_kwargs)
    for step, (w, kept) in enumerate(WINDOWS):
        start = eager.length
        window = _tokens(w, seed=step).to(device)
        want, want_taps = model(window, start, eager, tap_layers=taps or None)
        got, got_taps = runner(int(window[0, 0]), window[:, 1:] if w > 1 else None, start)
        _close(got, want, tol, rel)
        if taps:
            _close(got_taps, want_taps, tol, rel)
        end = start + w
        _close(static.buffer[:, :, :, :end], eager.buffer[:, :, :, :end], tol, rel)
        for cache in (eager, static):
            cache.commit(start + kept)
    return runner


def test_bucket_for_rounds_up_to_powers_of_two_within_capacity():
    """Buckets are the smallest power of two >= the window end, at least the minimum, never past capacity."""
    assert bucket_for(1, 4096) == 256
    assert bucket_for(256, 4096) == 256
    assert bucket_for(257, 4096) == 512
    assert bucket_for(3000, 3072) == 3072
    assert bucket_for(5, 64, smallest=4) == 8


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("fused", [False, True])
def test_static_step_matches_eager_forward(hf_dir, arch, fused):
    """Decode and verify windows through the bucketed, masked static step equal the eager forward (float32, 1e-5)."""
    loaded = load_hf(hf_dir(arch)[1], "cpu", torch.float32)
    _compare(loaded.model, loaded.config, "cpu", torch.float32, dict(capture=False, compiled=False, fused=fused, min_bucket=4))


def test_windows_run_padded_to_power_of_two_graphs(hf_dir):
    """A window of w tokens runs the graph of the next power of two (at most max_window): WINDOWS' widths 5 and 3
    run as 8 and 4 and still equal the eager forward on their own rows (taps included)."""
    assert [graph_width(w, 16) for w in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert graph_width(5, 6) == 6 and graph_width(17, 17) == 17
    assert graph_widths(16) == [1, 2, 4, 8, 16] and graph_widths(5) == [1, 2, 4, 5] and graph_widths(1) == [1]
    loaded = load_hf(hf_dir("qwen3")[1], "cpu", torch.float32)
    runner = _compare(loaded.model, loaded.config, "cpu", torch.float32, dict(capture=False, compiled=False, min_bucket=16),
                      taps=(0, 1))
    assert sorted({w for _, w, _ in runner.outputs}) == [1, 4, 8]


def test_static_step_taps_match_eager(hf_dir):
    """Feature taps (an inner layer and the last, after the final norm) equal the eager forward's."""
    loaded = load_hf(hf_dir("qwen3")[1], "cpu", torch.float32)
    _compare(loaded.model, loaded.config, "cpu", torch.float32, dict(capture=False, compiled=False, min_bucket=16), taps=(0, 1))


def test_attention_batch_layout_equals_single_sequence():
    """Folded attention gives each sequence of a batch what it gives that sequence alone (the batch-1 layout differs)."""
    from draftflow.layers.attention import attend_prefix as _attend

    gen = torch.Generator().manual_seed(0)
    w, kvh, g, d, s = 3, 2, 4, 16, 8
    q = torch.randn(2, kvh, g * w, d, generator=gen)
    keys, values = torch.randn(2, s, kvh, d, generator=gen), torch.randn(2, s, kvh, d, generator=gen)
    mask = torch.zeros(g * w, s).masked_fill_(torch.rand(g * w, s, generator=gen) < 0.3, float("-inf"))
    mask[:, 0] = 0.0
    both = _attend(q, keys, values, mask, w)
    for i in range(2):
        alone = _attend(q[i:i + 1], keys[i:i + 1], values[i:i + 1], mask, w)
        assert_close_to_scale(both[i:i + 1], alone, reduction_bound(d, 2), f"sequence {i}")  # q.k over d, p.v over s < d


def test_fuse_projections_keeps_parameters_and_outputs(hf_dir):
    """Fusing makes q/k/v and gate/up row views of one tensor each; eager logits and parameter bytes do not change."""
    loaded = load_hf(hf_dir("qwen2")[1], "cpu", torch.float32)  # qwen2: q/k/v biases are fused too
    m = loaded.model
    tokens = _tokens(7, seed=1)
    before, _ = m(tokens, 0, KVCache.growing(loaded.config, 1, 16, torch.float32, "cpu"))
    numel = sum(p.numel() for p in m.parameters())
    fuse_projections(m)
    fuse_projections(m)  # idempotent
    attn, mlp = m.layers[0].self_attn, m.layers[0].mlp
    assert joined([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is not None
    assert joined([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]) is not None
    assert joined([mlp.gate_proj.weight, mlp.up_proj.weight]) is not None
    assert sum(p.numel() for p in m.parameters()) == numel
    after, _ = m(tokens, 0, KVCache.growing(loaded.config, 1, 16, torch.float32, "cpu"))
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_runner_refuses_growing_cache_and_uncommitted_start(hf_dir):
    """The runner needs a static cache and, like the eager forward, a start within the committed length."""
    loaded = load_hf(hf_dir("qwen3")[1], "cpu", torch.float32)
    grow = KVCache.growing(loaded.config, 1, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match="needs a static KV cache"):
        GraphRunner(loaded.model, grow, 4, capture=False, compiled=False)
    static = KVCache.from_static(torch.zeros(static_shape(loaded.config, 1, 32)))
    runner = GraphRunner(loaded.model, static, 4, capture=False, compiled=False)
    with pytest.raises(ValueError, match=r"start_pos=3 but the KV cache holds only 0 committed"):
        runner(1, None, 3)


def _run_graph(path, device, dtype, oracle=None, swap_runner=None, cuda_graphs=True, n=40, taps=()):
    registry = load_registry(autoload=False)
    nodes = {"target": {"plugin": "target", "params": {"path": str(path), "cuda_graphs": cuda_graphs,
                                                        "tap_layers": list(taps)}},
             "verify": {"plugin": "verifier"}}
    if oracle is not None:
        nodes["oracle"] = {"plugin": "oracle", "params": oracle}
    spec = GraphSpec.from_dict({"device": device, "dtype": dtype, "num_draft": 4, "max_context": 128, "nodes": nodes})
    plan = build_plan(spec, registry)
    plan.raise_if_problems()
    ex = Executor(plan, hook=registry.pm.hook)
    if swap_runner is not None:
        target = ex.nodes["target"]
        target.runner = GraphRunner(target.model, target.cache, 5, target.taps or (), features=target.features,
                                    **swap_runner)
    return ex, ex.generate(PROMPT, SamplingParams(max_new_tokens=n, ignore_eos=True))


def test_target_node_through_static_step_equals_eager(hf_dir):
    """The target node driven through the runner (oracle drafts with errors, so windows are rejected) emits the eager tokens."""
    _, path = hf_dir("qwen3")
    _, reference = _run_graph(path, "cpu", "float32")
    oracle = {"reference": list(reference.token_ids), "errors": [3, 9, 10, 21]}
    ex, result = _run_graph(path, "cpu", "float32", oracle=oracle, taps=(1,),
                            swap_runner=dict(capture=False, compiled=False, min_bucket=16))
    assert result.token_ids == reference.token_ids
    assert result.stats["drafted"] > 0
    tokens = PROMPT + list(result.token_ids)
    _, taps = ex.nodes["target"].model(torch.tensor([tokens[:-1]]), 0,
                                           KVCache.growing(ex.nodes["target"].config, 1, 128, torch.float32, "cpu"),
                                           tap_layers=(1,))
    assert_close_to_scale(ex.nodes["target"].features[:, :len(tokens) - 1], taps, tiny_model_bound(2), "carried taps")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize(("arch", "compiled", "triton"), [("qwen3", False, False), ("qwen3", True, False),
                                                          ("qwen3", True, True), ("qwen2", True, True)])
def test_captured_graphs_match_eager_on_cuda(hf_dir, arch, compiled, triton):
    """Replayed CUDA graphs (plain, torch.compile'd pieces, Triton kernels) equal the eager forward in float32 across buckets."""
    loaded = load_hf(hf_dir(arch)[1], "cuda", torch.float32)
    runner = _compare(loaded.model, loaded.config, "cuda", torch.float32,
                      dict(capture=True, compiled=compiled, triton=triton, triton_attention=triton, elementwise=triton,
                           min_bucket=8),
                      taps=(0, 1), tol=1e-4)
    assert (runner.kernels.prologue is not None) == triton and (runner.kernels.split_attention is not None) == triton
    assert len({bucket for _, _, bucket in runner.graphs}) > 1  # windows crossed a bucket boundary


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_attention_over_a_long_cache_on_cuda(hf_dir, dtype):
    """With ~200 cached positions the Triton attention splits keys over several blocks and still equals the eager forward."""
    loaded = load_hf(hf_dir("qwen3")[1], "cuda", dtype)
    prompt = _tokens(197, seed=9)[0].tolist()
    fp32 = dtype == torch.float32
    runner = _compare(loaded.model, loaded.config, "cuda", dtype, dict(capture=True, min_bucket=64), capacity=512,
                      prompt=prompt, tol=1e-4 if fp32 else 3e-2, rel=not fp32)
    assert runner.kernels.split_attention is not None and {bucket for _, _, bucket in runner.graphs} == {256}


@needs_cuda
@pytest.mark.gpu
def test_triton_prologue_rounds_like_torch_ops_in_bf16(hf_dir):
    """In bf16 the Triton prologue writes the K/V that the torch ops write after the same fused product (K to 1-2 ulp)."""
    loaded = load_hf(hf_dir("qwen3")[1], "cuda", torch.bfloat16)
    m, cfg = loaded.model, loaded.config
    caches, logits = [], []
    for triton in (False, True):
        cache = KVCache.from_static(torch.zeros(static_shape(cfg, 1, 64), dtype=torch.bfloat16, device="cuda"))
        m(torch.tensor([PROMPT], device="cuda"), 0, cache)
        cache.commit(len(PROMPT))
        runner = GraphRunner(m, cache, 8, capture=False, compiled=False, triton=triton)
        window = _tokens(5, seed=3).cuda()
        logits.append(runner(int(window[0, 0]), window[:, 1:], len(PROMPT))[0].clone())
        caches.append(cache.buffer[0, :, :, len(PROMPT):len(PROMPT) + 5].float())  # layer 0: [2, B, 5, KVH, D]
    torch.testing.assert_close(caches[1][1], caches[0][1], atol=0, rtol=0)  # V is copied as is
    mismatched = (caches[1][0] != caches[0][0]).float().mean().item()
    assert mismatched < 0.05, f"{mismatched:.1%} of layer-0 keys differ: rounding no longer follows the torch ops"
    torch.testing.assert_close(caches[1][0], caches[0][0], atol=0, rtol=2 ** -7)
    torch.testing.assert_close(logits[1], logits[0], atol=0.25, rtol=0)


@needs_cuda
@pytest.mark.gpu
def test_cuda_graph_node_equals_eager_node(hf_dir):
    """Greedy output with cuda_graphs on (oracle drafts, rejections included) equals cuda_graphs off (float32)."""
    _, path = hf_dir("qwen3")
    _, reference = _run_graph(path, "cuda", "float32", cuda_graphs=False)
    oracle = {"reference": list(reference.token_ids), "errors": [3, 9, 10, 21]}
    ex, result = _run_graph(path, "cuda", "float32", oracle=oracle, cuda_graphs=True)
    assert ex.nodes["target"].runner is not None and ex.nodes["target"].runner.graphs
    assert result.token_ids == reference.token_ids


@needs_cuda
@pytest.mark.gpu
def test_cuda_graphs_track_eager_in_bf16(hf_dir):
    """In bf16 the default graph path (compiled pieces, Triton kernels) stays within bf16 rounding of the eager forward."""
    loaded = load_hf(hf_dir("qwen3")[1], "cuda", torch.bfloat16)
    _compare(loaded.model, loaded.config, "cuda", torch.bfloat16, dict(capture=True, min_bucket=8), taps=(1,),
             tol=3e-2, rel=True)


@needs_cuda
@pytest.mark.gpu
def test_prefill_runs_the_graph_kernels_and_matches_the_plain_forward(hf_dir):
    """On CUDA a dense target's prefill (eager, any length, here in 16-token chunks) runs the runner's Triton
    prologue and norm kernels; the prompt's K/V and taps equal the plain forward's (float32)."""
    _, path = hf_dir("qwen3")
    registry = load_registry(autoload=False)
    nodes = {"target": {"plugin": "target", "params": {"path": str(path), "tap_layers": [0, 1], "prefill_chunk": 16}},
             "verify": {"plugin": "verifier"}}
    spec = GraphSpec.from_dict({"device": "cuda", "dtype": "float32", "num_draft": 4, "max_context": 128,
                                "nodes": nodes})
    plan = build_plan(spec, registry)
    plan.raise_if_problems()
    ex = Executor(plan, hook=registry.pm.hook)
    target = ex.nodes["target"]
    assert target.prefill_kernels is target.runner.eager_kernels
    assert target.prefill_kernels.prologue is not None and target.prefill_kernels.split_attention is None
    prompt = _tokens(37, seed=5)[0].tolist()
    ex.generate(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
    n = len(prompt) - 1  # the last prompt token is the first window's anchor
    plain = KVCache.from_static(torch.zeros(static_shape(target.model.config, 1, 64), device="cuda"))
    _, taps = target.model(torch.tensor([prompt[:-1]], device="cuda"), 0, plain, tap_layers=(0, 1))
    assert_close_to_scale(target.cache.buffer[:, :, :1, :n], plain.buffer[:, :, :, :n], 1e-4, "prompt K/V")
    assert_close_to_scale(target.features[:1, :n], taps, 1e-4, "prompt taps")
