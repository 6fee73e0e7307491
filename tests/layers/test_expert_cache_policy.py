"""`ExpertCache.rebalance`'s promotion policy, every layer at once: per layer the best-scoring routed miss (lowest id on
ties) takes the slot of the worst-scoring resident expert the windows did not route (lowest id on ties), only when it
out-scores it by PROMOTE_MARGIN; the host map, the device map and the upload count follow."""

from __future__ import annotations

import torch

from draftflow.layers import expert_cache
from draftflow.layers.expert_cache import ExpertCache
from draftflow.layers.moe import HostExperts


def _cache(layers: int = 3, experts: int = 8, resident_per_layer: int = 3) -> ExpertCache:
    host = HostExperts(tuple(range(layers)), torch.randn(layers, experts, 4, 2), torch.randn(layers, experts, 2, 2))
    cache = ExpertCache(host, layers * resident_per_layer, 2, "cpu")  # warm start: experts 0, 1, 2 of every layer
    cache.device_path = True  # what CUDA would use; rebalance itself is host code
    return cache


def _route(cache: ExpertCache, counts: dict[int, dict[int, int]]) -> None:
    for row, per_expert in counts.items():
        for expert, n in per_expert.items():
            cache.staged[row, expert] += n


def test_each_layer_promotes_its_best_miss_into_its_worst_unrouted_slot():
    cache = _cache()
    # layer 0: misses 5 (x4) and 6 (x4) tie -> 5; victims 0 and 2 unrouted (1 routed), both score 0 -> expert 0's slot
    # layer 1: miss 7, but every resident expert was routed too: no victim
    # layer 2: only resident experts routed -> nothing
    _route(cache, {0: {5: 4, 6: 4, 1: 2}, 1: {7: 1, 0: 1, 1: 1, 2: 1}, 2: {0: 3, 1: 1}})
    cache.rebalance()
    l0, l1, l2 = cache.layers
    assert l0.expert_in == [5, 1, 2] and l0.slot_of[0] == -1 and l0.slot_of[6] == -1
    assert l1.expert_in == [0, 1, 2]
    assert l2.expert_in == [0, 1, 2]
    assert cache.upload_bytes == cache.bytes_per_expert
    assert cache.slot_keys.tolist() == [[s if s >= 0 else 3 for s in layer.slot_of] for layer in cache.layers]
    assert cache.resident_mask[0].nonzero().flatten().tolist() == [1, 2, 5]
    torch.testing.assert_close(cache.slot_gate_up[0], cache.host.gate_up[0, 5], rtol=0, atol=0)


def test_a_miss_must_out_score_its_victim_by_the_margin():
    cache = _cache(layers=1)
    _route(cache, {0: {0: 6, 1: 6}})  # residents 0 and 1 build scores; 2 stays at 0
    cache.rebalance()
    decay = expert_cache._DECAY_PER_TOKEN ** 1  # the next windows: one token each
    _route(cache, {0: {7: 1, 0: 1}})
    cache.rebalance()
    assert cache.layers[0].expert_in == [0, 1, 7]  # 7 (score 1) replaced 2 (score 0)
    _route(cache, {0: {6: 1, 0: 1}})  # 6 scores 1; the weakest unrouted resident is 7, now at `decay`
    cache.rebalance()
    assert cache.layers[0].expert_in == [0, 1, 7]  # 1 < decay + PROMOTE_MARGIN: 6 stays on the host
    assert cache.scores[0, 7].item() == decay and cache.scores[0, 6].item() == 1.0
    assert cache.upload_bytes == cache.bytes_per_expert
