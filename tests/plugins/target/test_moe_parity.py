"""Qwen3-MoE target against transformers (fp32, CPU) at full, half and a tenth of the experts resident."""

from __future__ import annotations

import pytest
import torch
from moe_testlib import NUM_EXPERTS, TOP_K, VOCAB, build_hf_moe, save_hf_moe
from numerics import scaled_error
from safetensors.torch import save_file
from target_testlib import hf_greedy, our_greedy

from draftflow.layers.expert_cache import ExpertCache
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.layers.kv_cache import KVCache
from draftflow.layers.moe import HostExperts

TOTAL = 2 * NUM_EXPERTS
FRACTIONS = {"full": TOTAL, "half": TOTAL // 2, "tenth": TOTAL // 10}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = build_hf_moe()
    return hf, load_hf(save_hf_moe(hf, tmp_path_factory.mktemp("moe") / "hf"), "cpu", torch.float32)


TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))  # [2, 24]


def test_logits_and_greedy_match_transformers_at_every_residency(pair):
    """Logits within 1e-4 of transformers and a 64-token greedy run identical, with full, half and a tenth resident."""
    hf, loaded = pair
    with torch.no_grad():
        ref = hf(TOKENS).logits
    prompt = TOKENS[:1, :8]
    want = hf_greedy(hf, prompt, 64)
    outputs = {}
    for name, resident in FRACTIONS.items():
        cache = loaded.model.set_expert_cache(resident)
        logits, _ = loaded.model(TOKENS, 0, KVCache.growing(loaded.config, 2, 64, torch.float32, "cpu"))
        assert scaled_error(logits, ref) <= 1e-4, name
        outputs[name] = logits
        assert our_greedy(loaded.model, loaded.config, prompt, 64) == want, name
        if resident < TOTAL:
            assert cache.misses > 0  # the small caches really evicted and uploaded
    # Numerics do not depend on residency: bit-equal logits whatever was resident.
    assert torch.equal(outputs["full"], outputs["half"]) and torch.equal(outputs["full"], outputs["tenth"])


def test_dense_layers_and_plain_topk_match_transformers(tmp_path):
    """mlp_only_layers keep the dense MLP, and norm_topk_prob=false leaves the top-k weights unnormalised."""
    hf = build_hf_moe(seed=4, layers=3, mlp_only_layers=(1,), norm_topk_prob=False)
    loaded = load_hf(save_hf_moe(hf, tmp_path / "hf"), "cpu", torch.float32)
    assert loaded.config.moe_layers == (0, 2) and not loaded.config.norm_topk_prob
    with torch.no_grad():
        ref = hf(TOKENS).logits
    loaded.model.set_expert_cache(2 * TOP_K + 3)
    logits, _ = loaded.model(TOKENS, 0, KVCache.growing(loaded.config, 2, 64, torch.float32, "cpu"))
    assert scaled_error(logits, ref) <= 1e-4


def test_fused_transformers5_expert_tensors_load(pair, tmp_path):
    """A checkpoint holding fused mlp.experts.gate_up_proj / down_proj loads to the same logits as per-expert tensors."""
    hf, loaded = pair
    (tmp_path / "fused").mkdir()
    save_hf_moe(hf, tmp_path / "src")
    state = {n: p.detach().contiguous() for n, p in hf.named_parameters()}  # transformers 5 in-memory: fused 3-D
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)
    save_file(state, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    fused = load_hf(tmp_path / "fused", "cpu", torch.float32)
    a, _ = fused.model(TOKENS, 0, KVCache.growing(fused.config, 2, 64, torch.float32, "cpu"))
    loaded.model.set_expert_cache(None)
    b, _ = loaded.model(TOKENS, 0, KVCache.growing(loaded.config, 2, 64, torch.float32, "cpu"))
    assert torch.equal(a, b)


def test_window_uploads_each_missing_expert_once():
    """A window routes all tokens at once: misses = distinct routed experts not resident, bytes = misses x expert size."""
    e, h, i = 8, 16, 8
    host = HostExperts((0,), torch.randn(1, e, 2 * i, h), torch.randn(1, e, h, i))
    cache = ExpertCache(host, 3, 2, "cpu")  # experts 0, 1, 2 resident
    layer = cache.layers[0]
    ids = torch.tensor([[5, 6], [6, 1], [5, 7], [7, 6]])  # [4 tokens, k=2]: distinct {1, 5, 6, 7}, resident {1}
    out = layer.compute(torch.randn(4, h), ids, torch.full((4, 2), 0.5))
    assert out.shape == (4, h)
    assert (cache.hits, cache.misses) == (1, 3)  # 4 distinct experts, 3 missing; a 3-slot layer needs 2 passes
    assert cache.upload_bytes == 3 * (3 * h * i * 4)


def test_eviction_keeps_frequently_routed_experts():
    """The routing-frequency score evicts a rarely routed expert before a hot one."""
    e, h, i = 8, 8, 4
    host = HostExperts((0,), torch.randn(1, e, 2 * i, h), torch.randn(1, e, h, i))
    cache = ExpertCache(host, 2, 1, "cpu")
    layer = cache.layers[0]
    x = torch.randn(1, h)
    for expert in (0, 0, 0, 1, 5):  # 0 is hot; 5 must evict the cold 1, not 0
        layer.compute(x, torch.tensor([[expert]]), torch.ones(1, 1))
    assert layer.slot_of[0] >= 0 and layer.slot_of[5] >= 0 and layer.slot_of[1] < 0


def test_expert_cache_size_is_validated():
    """Fewer than top-k slots per MoE layer, or more than every expert, is rejected with the valid range."""
    host = HostExperts((0, 1), torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 4))
    with pytest.raises(ValueError, match=r"expert_cache=3 is outside \[4, 8\]"):
        ExpertCache(host, 3, 2, "cpu")
