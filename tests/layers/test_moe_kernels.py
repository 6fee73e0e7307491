"""The fused MoE kernels (routing on the device, experts grouped by expert) compute what the expert cache's path does.

Run on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before triton loads),
at tiny shapes, float32 with a tight tolerance; with CUDA the same tests run compiled on the
GPU, and tests/plugins/target/test_moe_cuda.py adds bf16 and larger shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from draftflow.layers import moe_kernels  # noqa: E402
from draftflow.layers.config import TargetConfig  # noqa: E402
from draftflow.layers.expert_cache import ExpertCache  # noqa: E402
from draftflow.layers.moe import HostExperts, SparseMoeBlock, route  # noqa: E402

HIDDEN, WIDTH = 64, 32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _config(experts: int, top_k: int, norm: bool, shared: int = 0) -> TargetConfig:
    return TargetConfig.from_hf_dict(dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=64, hidden_size=HIDDEN,
        intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=False,
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=WIDTH, norm_topk_prob=norm,
        shared_expert_intermediate_size=shared), "tiny-moe")


def _block(experts: int, top_k: int, norm: bool, seed: int, shared: int = 0) -> tuple[SparseMoeBlock, ExpertCache]:
    """One MoE block with random float32 weights and every expert resident in an expert cache."""
    cfg = _config(experts, top_k, norm, shared)
    gen = torch.Generator().manual_seed(seed)
    block = SparseMoeBlock(cfg, torch.float32, "cpu")
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    gate_up = torch.randn(1, experts, 2 * WIDTH, HIDDEN, generator=gen) / HIDDEN ** 0.5
    down = torch.randn(1, experts, HIDDEN, WIDTH, generator=gen) / WIDTH ** 0.5
    block = block.to(DEVICE)
    if DEVICE == "cuda":  # the partly resident cache's kernels read misses from pinned host memory
        gate_up, down = gate_up.pin_memory(), down.pin_memory()
    cache = ExpertCache(HostExperts((0,), gate_up, down), None, top_k, DEVICE)
    cache.attach([block])
    return block, cache


def _both(block: SparseMoeBlock, cache: ExpertCache, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the expert cache's host-synced path, the device path) on the same input."""
    cache.device_path = False
    want = block(x)
    cache.device_path = True
    return want, block(x)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("tokens", [1, 4, 16, 33])
def test_fused_block_matches_the_expert_cache_path(tokens, top_k, norm):
    """Decode and verify windows (repeated experts across tokens; routing weights renormalised or the raw top-k
    probabilities) give the grouped path's output, float32 1e-5."""
    block, cache = _block(16, top_k, norm=norm, seed=tokens + top_k)
    x = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens), device="cpu").to(DEVICE)
    want, got = _both(block, cache, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    ids = route(block.gate(x.reshape(-1, HIDDEN)), top_k, norm, torch.float32)[1]
    # The kernels count each distinct expert once per window (every one a hit: all resident) and its tokens.
    tally = cache.tally[0].cpu()
    assert tally[-2:].tolist() == [ids.unique().numel(), 0]
    assert torch.equal(tally[:-2], torch.bincount(ids.reshape(-1).cpu(), minlength=16).int())
    assert cache.counters()["expert_hits"] == cache.hits + ids.unique().numel()


@pytest.mark.parametrize("norm", [True, False])
def test_route_topk_matches_route(norm):
    """Softmax in float32, top-k largest first, optional renormalisation: the ids and weights of moe.route."""
    logits = torch.randn(7, 48, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want_w, want_ids = route(logits, 6, norm, torch.float32)
    got_w, got_ids = moe_kernels.route_topk(logits, 6, norm, torch.float32)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)
    if norm:
        torch.testing.assert_close(got_w.sum(-1), torch.ones(7, device=DEVICE))


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("experts,hidden,tokens", [(48, 64, 3), (130, 40, 1)])
def test_router_topk_is_the_router_gemv_then_route(experts, hidden, tokens, norm):
    """The router's GEMV and routing in one launch (many expert blocks, one last arriver per token; widths not
    multiples of the blocks): moe.route's ids on F.linear's logits, its weights to float32 rounding, and every
    arrival counter back at zero (a CUDA graph replays the launch)."""
    from draftflow.layers.triton_kernels import arrival_counters

    gen = torch.Generator().manual_seed(experts + tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    weight = torch.randn(experts, hidden, generator=gen).to(DEVICE)
    want_w, want_ids = route(torch.nn.functional.linear(x, weight), 6, norm, torch.float32)
    got_w, got_ids = moe_kernels.router_topk(x, weight, 6, norm)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)
    assert not arrival_counters(x.device).any()


@pytest.mark.parametrize("offset", [False, True])
def test_add_rms_route_is_the_norm_then_the_router(offset):
    """The residual add, post-attention RMSNorm (with Qwen3-Next's (1 + w) offset too) and the router in one launch:
    the plain ops' sum and normed rows, and moe.route's ids on F.linear of the normed rows (float32)."""
    from draftflow.layers import fused

    gen = torch.Generator().manual_seed(7)
    x, delta = (torch.randn(1, 3, 40, generator=gen).to(DEVICE) for _ in range(2))
    norm_w = torch.randn(40, generator=gen).to(DEVICE)
    weight = torch.randn(48, 40, generator=gen).to(DEVICE)
    want_sum, want_normed = fused.add_rms(x, delta, norm_w, 1e-6, offset)
    want_w, want_ids = route(torch.nn.functional.linear(want_normed.reshape(3, 40), weight), 4, True, torch.float32)
    total, normed, (got_w, got_ids) = moe_kernels.add_rms_route(x, delta, norm_w, 1e-6, offset, weight, 4, True)
    torch.testing.assert_close(total, want_sum, atol=0, rtol=0)
    torch.testing.assert_close(normed, want_normed, atol=1e-6, rtol=1e-5)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)


def test_shared_expert_and_a_batch_of_rows():
    """A shared expert (Qwen3-Next) and a [2, 3] batch of windows, raw top-k weights: still the grouped path's output."""
    block, cache = _block(8, 2, norm=False, seed=5, shared=48)
    x = torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    want, got = _both(block, cache, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_slots_follow_the_residency_map():
    """Experts in shuffled slots are read through slot_of[e]; a 70-token window loops over token blocks."""
    gen = torch.Generator().manual_seed(3)
    e, k, n = 12, 3, 70
    gate_up, down = torch.randn(e, 2 * WIDTH, HIDDEN, generator=gen) / 8, torch.randn(e, HIDDEN, WIDTH, generator=gen) / 6
    x = torch.randn(n, HIDDEN, generator=gen)
    weights, ids = route(torch.randn(n, e, generator=gen), k, True, torch.float32)
    gate, up = torch.einsum("nh,nkih->nki", x, gate_up[ids]).chunk(2, dim=-1)  # [N, k, I] each
    rows = torch.einsum("nki,nkhi->nkh", torch.nn.functional.silu(gate) * up, down[ids])  # [N, k, H]
    want = (rows * weights[..., None]).sum(dim=1)
    slot_of = torch.randperm(e, generator=gen)
    slots_gu, slots_d = torch.empty_like(gate_up), torch.empty_like(down)
    slots_gu[slot_of], slots_d[slot_of] = gate_up, down
    tally = torch.zeros(e + 2, dtype=torch.int32)
    got = moe_kernels.fused_experts(*(t.to(DEVICE) for t in (x, ids, weights, slots_gu, slots_d, slot_of, tally)))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_long_window_uses_device_offsets_and_matches():
    """Past FUSED_MAX_TOKENS the device path groups rows with offsets computed on the device: same output, hits counted."""
    block, cache = _block(16, 4, norm=True, seed=9)
    x = torch.randn(1, moe_kernels.FUSED_MAX_TOKENS + 36, HIDDEN, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    want, got = _both(block, cache, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert cache.tally[0, -2:].tolist() == [16, 0]


def test_partial_residency_reads_misses_from_host_memory():
    """6 of 16 experts resident: misses are read from the host stacks, bit-equal to all resident; `rebalance` then
    uploads a routed expert into the slot of an unrouted one, and the output stays bit-equal with one miss fewer."""
    block, full = _block(16, 4, norm=True, seed=11)
    x = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    full.device_path = True
    want = block(x)
    cache = ExpertCache(full.host, 6, 4, DEVICE)
    cache.attach([block])
    cache.device_path = True
    assert cache.capturable(64) and not cache.capturable(65) and full.capturable(10_000)
    got = block(x)
    assert torch.equal(got, want)
    routed = route(block.gate(x.reshape(-1, HIDDEN)), 4, True, torch.float32)[1].unique().tolist()
    missing = [e for e in routed if e >= 6]  # the warm start holds experts 0..5
    assert cache.tally[0, -2:].tolist() == [len(routed) - len(missing), len(missing)] and missing
    cache.rebalance()
    promoted = cache.upload_bytes // cache.bytes_per_expert
    assert promoted == 1 and cache.resident_mask[0].sum() == 6  # PROMOTE_PER_LAYER
    assert cache.resident_mask[0, missing].sum() == promoted  # uploaded experts are ones the window missed
    layer = cache.layers[0]
    assert all(layer.slot_of[layer.expert_in[s]] == s for s in range(6))
    assert [int(k) for k in layer.slot_key] == [s if s >= 0 else 6 for s in layer.slot_of]  # device map follows
    assert torch.equal(block(x), want)
    assert cache.tally[0, -1] == 2 * len(missing) - promoted


def _experts(e: int, n: int, k: int, norm: bool, seed: int):
    """Random expert stacks, tokens and routing; the reference sum over top-k in float32 einsums."""
    gen = torch.Generator().manual_seed(seed)
    gate_up, down = torch.randn(e, 2 * WIDTH, HIDDEN, generator=gen) / 8, torch.randn(e, HIDDEN, WIDTH, generator=gen) / 6
    x = torch.randn(n, HIDDEN, generator=gen)
    weights, ids = route(torch.randn(n, e, generator=gen), k, norm, torch.float32)
    gate, up = torch.einsum("nh,nkih->nki", x, gate_up[ids]).chunk(2, dim=-1)  # [N, k, I] each
    rows = torch.einsum("nki,nkhi->nkh", torch.nn.functional.silu(gate) * up, down[ids])  # [N, k, H]
    return (x, ids, weights, gate_up, down), (rows * weights[..., None]).sum(dim=1)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_few_token_kernels_match_the_grouped_kernels(tokens, top_k, norm):
    """Decode and short windows (<= 32 pairs) take the two few-token launches: gate/up split over K chunks (reduced by
    the last chunk's program) and down with the top-k sum fused; same output and tally as the grouped kernels, the
    arrival counters left zeroed, and a second run bit-equal (a fixed reduction order)."""
    e = 16
    (x, ids, weights, gate_up, down), want = _experts(e, tokens, top_k, norm, seed=7 * tokens + top_k)
    args = [t.to(DEVICE) for t in (x, ids, weights, gate_up, down, torch.arange(e))]
    counters = torch.zeros(moe_kernels.counter_size(HIDDEN, WIDTH), dtype=torch.int32, device=DEVICE)
    out, tallies = {}, {}
    for path in ("small", "grouped"):
        tallies[path] = torch.zeros(e + 2, dtype=torch.int32, device=DEVICE)
        out[path] = moe_kernels.fused_experts(*args, tallies[path], path=path, counters=counters)
        torch.testing.assert_close(out[path].cpu(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(tallies["small"], tallies["grouped"])
    assert tallies["small"][-2:].tolist() == [ids.unique().numel(), 0]
    assert not counters.any()
    again = moe_kernels.fused_experts(*args, torch.zeros(e + 2, dtype=torch.int32, device=DEVICE), counters=counters)
    assert torch.equal(again, out["small"])


@pytest.mark.parametrize("config", [(8, 1, 16), (16, 4, 32)])
def test_few_token_configs_and_dispatch(config):
    """Any accepted (gate/up columns, K chunks, down columns) gives the same sums (one K chunk: no reduce; four);
    windows past 32 pairs or 8 tokens take the grouped kernels, and asking for the few-token ones there is an error."""
    e = 8
    (x, ids, weights, gate_up, down), want = _experts(e, 3, 2, False, seed=21)
    args = [t.to(DEVICE) for t in (x, ids, weights, gate_up, down, torch.arange(e))]
    tally = torch.zeros(e + 2, dtype=torch.int32, device=DEVICE)
    got = moe_kernels.fused_experts(*args, tally, path="small", small=config)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    (x, ids, weights, *_), _ = _experts(e, 9, 2, False, seed=22)  # 9 tokens: 18 pairs but past SMALL_MAX_TOKENS
    with pytest.raises(ValueError, match="few-token MoE kernels serve"):
        moe_kernels.fused_experts(x, ids, weights, *args[3:], tally, path="small")
    with pytest.raises(ValueError, match="needs >= 8 gate/up columns"):
        moe_kernels.fused_experts(*args, tally, path="small", small=(4, 1, 16))


@pytest.mark.parametrize("tokens", [1, 2])
def test_few_token_block_with_a_shared_expert(tokens):
    """The Qwen3-Next block (shared expert, top-8 of 16, raw weights) on decode and 2-token windows: the host-routed
    path's output, the layer's arrival counters left zeroed."""
    block, cache = _block(16, 8, norm=False, seed=30 + tokens, shared=48)
    x = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    want, got = _both(block, cache, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert cache.layers[0].arrivals is not None and not cache.layers[0].arrivals.any()
