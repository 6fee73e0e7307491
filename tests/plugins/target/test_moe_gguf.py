"""MoE HF -> GGUF (llama.cpp qwen3moe naming, merged or per-expert) -> the same logits."""

from __future__ import annotations

import gguf
import pytest
import torch
from moe_testlib import VOCAB, build_hf_moe, save_hf_moe

from draftflow.plugins.target.gguf_loader import load_gguf
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.layers.kv_cache import KVCache
from draftflow.tools.convert_gguf import convert_hf_to_gguf

TOKENS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(11))  # [2, 20]


def _logits(loaded, resident=None) -> torch.Tensor:
    loaded.model.set_expert_cache(resident)
    return loaded.model(TOKENS, 0, KVCache.growing(loaded.config, 2, 32, torch.float32, "cpu"))[0]  # [2, 20, V]


@pytest.mark.parametrize("layout", ["merged", "per-expert"])
def test_moe_gguf_round_trip_is_exact(tmp_path, layout):
    """F32 GGUF in either expert layout loads to exactly the HF logits, also with a tenth of the experts resident."""
    path = save_hf_moe(build_hf_moe(layers=3, mlp_only_layers=(1,)), tmp_path / "hf")
    convert_hf_to_gguf(path, tmp_path / "m.gguf", "f32", layout)
    names = {t.name: [int(d) for d in t.shape] for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    if layout == "merged":
        assert names["blk.0.ffn_gate_exps.weight"] == [64, 32, 48]  # ne = {H, I, E}, as llama.cpp stores it
        assert names["blk.2.ffn_down_exps.weight"] == [32, 64, 48]
    else:
        assert names["blk.0.ffn_gate.47.weight"] == [64, 32]
    assert "blk.0.ffn_gate_inp.weight" in names and "blk.1.ffn_gate.weight" in names  # layer 1 stays dense
    from_gguf, from_hf = load_gguf(tmp_path / "m.gguf", "cpu", torch.float32), load_hf(path, "cpu", torch.float32)
    assert from_gguf.config.arch == "qwen3_moe" and from_gguf.config.moe_layers == (0, 2)
    assert from_gguf.config.norm_topk_prob and from_gguf.config.num_experts_per_tok == 4
    assert torch.equal(_logits(from_gguf), _logits(from_hf))
    assert torch.equal(_logits(from_gguf, 9), _logits(from_hf))
