"""MoE on CUDA with every expert resident: the fused kernels against the expert cache's GEMMs, captured graphs
against the eager forward, and the target node's greedy tokens under CUDA graphs against eager and target-only."""

from __future__ import annotations

import pytest
import torch
from moe_testlib import VOCAB, build_hf_moe, moe_dflash_pair, save_hf_moe
from numerics import assert_close_to_scale, tiny_model_bound

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import GraphSpec
from draftflow.layers.config import TargetConfig
from draftflow.layers.expert_cache import ExpertCache
from draftflow.layers.kv_cache import KVCache, static_shape
from draftflow.layers.moe import HostExperts, SparseMoeBlock, route
from draftflow.plugins.target.graphs import GraphRunner
from draftflow.plugins.target.hf_loader import load_hf

triton = pytest.importorskip("triton")
from draftflow.layers.moe_kernels import add_rms_route, route_topk, router_topk  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32]
WINDOWS = [(1, 1), (6, 2), (1, 1), (6, 6), (4, 1), (1, 1)]  # (window length, tokens kept)


def _block(experts: int, top_k: int, hidden: int, width: int, dtype: torch.dtype, seed: int):
    """A MoE block (random weights, unit-scale outputs) with every expert resident on CUDA."""
    cfg = TargetConfig.from_hf_dict(dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=64, hidden_size=hidden,
        intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=False,
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width, norm_topk_prob=True), "moe")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    block = SparseMoeBlock(cfg, dtype, "cuda")
    with torch.no_grad():
        block.gate.weight.normal_(0.0, hidden ** -0.5, generator=gen)
    gate_up = torch.randn(1, experts, 2 * width, hidden, generator=gen, device="cuda").mul_(hidden ** -0.5).to(dtype)
    down = torch.randn(1, experts, hidden, width, generator=gen, device="cuda").mul_(width ** -0.5).to(dtype)
    cache = ExpertCache(HostExperts((0,), gate_up.cpu(), down.cpu()), None, top_k, "cuda")
    cache.attach([block])
    assert cache.device_path
    return block, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("tokens", [1, 4, 16, 17, 33, 100])
def test_fused_experts_match_the_expert_cache_on_cuda(tokens, top_k, dtype):
    """Decode, verify and long windows (128 experts, widths not multiples of the blocks): the host-routed per-expert
    GEMMs' output on the same routing, float32 to 1e-5 of scale, bf16 within bf16 rounding; each distinct expert
    counted once. (The same routing: bf16 router logits tie often, and ties may break either way.)"""
    block, cache = _block(128, top_k, 320, 96, dtype, seed=tokens * top_k)
    x = torch.randn(tokens, 320, generator=torch.Generator(device="cuda").manual_seed(tokens), device="cuda").to(dtype)
    with torch.inference_mode():
        weights, ids = route_topk(block.gate(x), top_k, True, dtype)
        want = block.experts.compute(x, ids, weights).float()
        got = block.experts.compute_device(x, ids, weights).float()
    if dtype == torch.float32:
        assert_close_to_scale(got, want, 1e-5, "fused experts")
    else:
        err = ((got - want).norm() / want.norm()).item()
        assert err < 4e-3, f"bf16 relative error {err:.2e}"
    assert cache.tally[0, -2:].tolist() == [ids.unique().numel(), 0]


@pytest.mark.parametrize("norm", [True, False])
def test_route_topk_matches_route_on_cuda(norm):
    """float32 router logits (no ties): the ids of moe.route, its weights to float32 rounding."""
    logits = torch.randn(33, 128, generator=torch.Generator(device="cuda").manual_seed(0), device="cuda")
    want_w, want_ids = route(logits, 8, norm, torch.float32)
    got_w, got_ids = route_topk(logits, 8, norm, torch.float32)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,top_k", [(128, 8), (512, 10)])
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_router_topk_is_the_router_gemv_then_route_on_cuda(tokens, experts, top_k, dtype):
    """The fused router (GEMV + routing, one launch) at the 30B and 80B shapes (hidden 2048), decode to the longest
    fused window, eager and replayed in a CUDA graph: float32 gives route_topk(F.linear)'s ids and weights; bf16 rounds
    its logits to bf16 as cuBLAS's output is, so ids agree except where two logits are a bf16 step apart (ties)."""
    gen = torch.Generator(device="cuda").manual_seed(tokens + experts)
    x = torch.randn(tokens, 2048, generator=gen, device="cuda").to(dtype)
    weight = (torch.randn(experts, 2048, generator=gen, device="cuda") * 2048 ** -0.5).to(dtype)
    with torch.inference_mode():
        want_w, want_ids = route_topk(torch.nn.functional.linear(x, weight), top_k, True, dtype)
        got_w, got_ids = router_topk(x, weight, top_k, True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replay_w, replay_ids = router_topk(x, weight, top_k, True)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(replay_ids, got_ids) and torch.equal(replay_w, got_w)
    if dtype == torch.float32:
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)
    else:
        same = (got_ids.sort(-1).values == want_ids.sort(-1).values).all(-1).float().mean().item()
        assert same >= 0.9, f"only {same:.0%} of tokens routed to the same experts"
        torch.testing.assert_close(got_w.float().sort(-1).values, want_w.float().sort(-1).values, atol=2e-2, rtol=0)


@pytest.mark.parametrize("tokens", [1, 16])
def test_add_rms_route_is_add_rms_then_the_router_on_cuda(tokens):
    """bf16 at the 80B shape (hidden 2048, 512 experts, top-10, the (1 + w) norm): the Triton add_rms's sum and normed
    rows bit for bit, and the fused router's routing on them (ties aside)."""
    from draftflow.layers import triton_kernels as tk

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x, delta = (torch.randn(1, tokens, 2048, generator=gen, device="cuda").bfloat16() for _ in range(2))
    norm_w = (torch.randn(2048, generator=gen, device="cuda") * 0.1).bfloat16()
    weight = (torch.randn(512, 2048, generator=gen, device="cuda") * 2048 ** -0.5).bfloat16()
    with torch.inference_mode():
        want_sum, want_normed = tk.add_rms(x, delta, norm_w, 1e-6, True)
        want_w, want_ids = router_topk(want_normed.reshape(tokens, 2048), weight, 10, True)
        total, normed, (got_w, got_ids) = add_rms_route(x, delta, norm_w, 1e-6, True, weight, 10, True)
    assert torch.equal(total, want_sum) and torch.equal(normed, want_normed)
    same = (got_ids.sort(-1).values == want_ids.sort(-1).values).all(-1).float().mean().item()
    assert same >= 0.9, f"only {same:.0%} of tokens routed to the same experts"


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return save_hf_moe(build_hf_moe(seed=2), tmp_path_factory.mktemp("moe") / "hf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_moe_windows_equal_the_eager_forward(tiny_moe, dtype):
    """Decode and verify windows replayed as CUDA graphs give the eager forward's logits (float32 to rounding; bf16
    within bf16 rounding of it), with the runner's Triton attention pieces around the fused MoE layers."""
    loaded = load_hf(tiny_moe, "cuda", dtype)
    model, cfg = loaded.model, loaded.config
    eager = KVCache.from_static(torch.zeros(static_shape(cfg, 1, 64), dtype=dtype, device="cuda"))
    static = KVCache.from_static(torch.zeros(static_shape(cfg, 1, 64), dtype=dtype, device="cuda"))
    with torch.inference_mode():
        for cache in (eager, static):
            model(torch.tensor([PROMPT], device="cuda"), 0, cache)
            cache.commit(len(PROMPT))
        runner = GraphRunner(model, static, max_window=8, capture=True, min_bucket=16)
        assert model.expert_cache.device_path
        for step, (w, kept) in enumerate(WINDOWS):
            start = eager.length
            window = torch.randint(0, VOCAB, (1, w), generator=torch.Generator().manual_seed(step)).cuda()
            want, _ = model(window, start, eager)
            got, _ = runner(int(window[0, 0]), window[:, 1:] if w > 1 else None, start)
            if dtype == torch.float32:
                assert_close_to_scale(got, want, tiny_model_bound(2), f"window {step}")
            else:
                err = ((got - want).norm() / want.norm()).item()
                assert err < 3e-2, f"window {step}: bf16 relative error {err:.2e}"
            for cache in (eager, static):
                cache.commit(start + kept)
    assert len(runner.graphs) >= 2


def test_pdl_launches_replay_bit_identical_to_plain_launches(tiny_moe, monkeypatch):
    """bf16 decode and verify windows captured with programmatic dependent launch (triton_kernels.PDL: every Triton
    kernel of the step waits for its predecessor in-kernel) give bit for bit the logits of the same graphs captured
    with plain launches; on an sm_90+ GPU the launches do take the option."""
    from draftflow.layers import triton_kernels

    loaded = load_hf(tiny_moe, "cuda", torch.bfloat16)
    model, cfg = loaded.model, loaded.config
    if torch.cuda.get_device_capability()[0] >= 9:
        assert triton_kernels.pdl(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(triton_kernels, "PDL", on)
        cache = KVCache.from_static(torch.zeros(static_shape(cfg, 1, 64), dtype=torch.bfloat16, device="cuda"))
        with torch.inference_mode():
            model(torch.tensor([PROMPT], device="cuda"), 0, cache)
            cache.commit(len(PROMPT))
            runner = GraphRunner(model, cache, max_window=8, capture=True, min_bucket=16)
            logits[on] = []
            for step, (w, kept) in enumerate(WINDOWS):
                start = cache.length
                window = torch.randint(0, VOCAB, (1, w), generator=torch.Generator().manual_seed(step)).cuda()
                got, _ = runner(int(window[0, 0]), window[:, 1:] if w > 1 else None, start)
                logits[on].append(got.clone())
                cache.commit(start + kept)
    assert not triton_kernels.pdl(torch.device("cpu"))
    for step, (got, want) in enumerate(zip(logits[True], logits[False])):
        assert torch.equal(got, want), f"window {step}"


def _generate(target: str, drafter: str | None, cuda_graphs: bool, expert_cache: int = 0):
    registry = load_registry()
    params = {"path": target, "cuda_graphs": cuda_graphs, "expert_cache": expert_cache}
    nodes = {"target": {"plugin": "target", "params": params}, "verify": {"plugin": "verifier"}}
    if drafter is not None:
        params["tap_layers"] = [1, 2]
        nodes["drafter"] = {"plugin": "dflash", "params": {"path": drafter}}
    spec = GraphSpec.from_dict({"device": "cuda", "dtype": "float32", "num_draft": 5, "max_context": 128,
                                "nodes": nodes})
    plan = build_plan(spec, registry)
    plan.raise_if_problems()
    ex = Executor(plan, hook=registry.pm.hook)
    result = ex.generate([3, 4, 5, 6], SamplingParams(max_new_tokens=32, ignore_eos=True))
    return ex.nodes["target"], result


def test_moe_node_under_cuda_graphs_equals_eager_and_target_only(tmp_path):
    """All experts resident: DFlash + MoE target under CUDA graphs emits the target-only greedy tokens, the same as
    the eager forward and as half residency (float32). Half resident runs under graphs too when the kernels can read
    misses from pinned host memory (the device path), else eagerly on the host-routed path."""
    target, drafter = (str(p) for p in moe_dflash_pair(tmp_path))
    spec_node, spec = _generate(target, drafter, cuda_graphs=True)
    only_node, only = _generate(target, None, cuda_graphs=True)
    _, eager = _generate(target, None, cuda_graphs=False)
    cache_node, cached = _generate(target, None, cuda_graphs=True, expert_cache=24)
    assert spec_node.runner is not None and len(spec_node.runner.graphs) > 0
    experts = cache_node.model.expert_cache
    assert only_node.runner is not None and (cache_node.runner is not None) == experts.device_path
    assert experts.resident == 24 and experts.counters()["expert_misses"] > 0
    assert spec.token_ids == only.token_ids == eager.token_ids == cached.token_ids
    assert 0 < spec.stats["accepted"]


def test_promotions_between_windows_do_not_synchronise():
    """A partly resident cache: a window reads two missing experts from pinned host memory; `rebalance` then uploads
    the better-scoring one and updates the device residency map with no host sync (torch's sync debug mode set to
    error), and the map on the device equals the host's."""
    experts, top_k, hidden, width = 32, 2, 64, 32
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(1, experts, 2 * width, hidden, generator=gen).pin_memory()
    down = torch.randn(1, experts, hidden, width, generator=gen).pin_memory()
    cache = ExpertCache(HostExperts((0,), gate_up, down), 4, top_k, "cuda")  # slots start with experts 0..3
    assert cache.device_path and not cache.all_resident
    layer = cache.layers[0]
    x = torch.randn(8, hidden, device="cuda")
    ids = torch.tensor([[30, 31]] * 7 + [[30, 1]], device="cuda")
    weights = torch.full((8, 2), 0.5, device="cuda")
    with torch.inference_mode():
        layer.compute_device(x, ids, weights)
    torch.cuda.synchronize()
    before = cache.upload_bytes
    torch.cuda.set_sync_debug_mode("error")
    try:
        cache.rebalance()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cache.upload_bytes == before + cache.bytes_per_expert  # one promotion per layer and rebalance
    assert layer.slot_of[30] >= 0 and layer.slot_of[31] < 0  # 30 was routed 8 times, 31 7 times
    host_map = [s if s >= 0 else layer.size for s in layer.slot_of]
    assert layer.slot_key.cpu().tolist() == host_map
    torch.testing.assert_close(cache.slot_gate_up[layer.slot_of[30]].cpu(), gate_up[0, 30], rtol=0, atol=0)
