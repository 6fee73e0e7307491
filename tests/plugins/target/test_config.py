"""TargetConfig parsing from HF config.json dicts and the size helpers."""

from __future__ import annotations

import pytest
import torch

from draftflow.layers.config import TargetConfig, expected_tensors, kv_bytes_per_token, weight_bytes
from draftflow.core.errors import ModelFormatError

BASE = {
    "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "eos_token_id": [5, 6], "bos_token_id": 1,
}


def _cfg(**extra) -> TargetConfig:
    return TargetConfig.from_hf_dict({**BASE, **extra}, "/m/config.json")


def test_arch_specific_flags():
    """qwen3 gets q/k norm, qwen2 gets q/k/v bias only, llama follows attention_bias."""
    qwen3 = _cfg(architectures=["Qwen3ForCausalLM"])
    assert (qwen3.arch, qwen3.qk_norm, qwen3.attention_bias) == ("qwen3", True, False)
    qwen2 = _cfg(architectures=["Qwen2ForCausalLM"])
    assert (qwen2.attention_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    llama = _cfg(model_type="llama", attention_bias=True)
    assert (llama.arch, llama.attention_bias, llama.o_bias) == ("llama", True, True)
    assert llama.head_dim == 8 and llama.eos_token_ids == (5, 6)


def test_llama3_rope_from_old_and_new_layouts():
    """llama3 scaling is read from transformers-4 `rope_scaling` and transformers-5 `rope_parameters`."""
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    old = _cfg(architectures=["LlamaForCausalLM"], rope_theta=5e5, rope_scaling=params)
    new = _cfg(architectures=["LlamaForCausalLM"], rope_parameters={**params, "rope_theta": 5e5})
    assert old.rope_scaling == new.rope_scaling and old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling.factor == 8.0
    plain = _cfg(architectures=["LlamaForCausalLM"], rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert plain.rope_scaling is None


def test_unsupported_architecture_names_it_and_lists_supported():
    """An unknown architecture raises naming it and listing the supported ones."""
    with pytest.raises(ModelFormatError, match=r"/m/config.json: architecture 'MistralForCausalLM' is not "
                       r"supported; expected one of Qwen3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM"):
        _cfg(architectures=["MistralForCausalLM"])


def test_unsupported_rope_and_missing_field():
    """yarn RoPE and a missing hidden_size raise one-line errors naming the field."""
    with pytest.raises(ModelFormatError, match=r"field 'rope_type' is 'yarn'; expected 'default' or 'llama3'"):
        _cfg(architectures=["Qwen3ForCausalLM"], rope_parameters={"rope_type": "yarn", "factor": 4.0})
    bad = {k: v for k, v in BASE.items() if k != "hidden_size"}
    with pytest.raises(ModelFormatError, match=r"field 'hidden_size' is None; expected a positive integer"):
        TargetConfig.from_hf_dict({**bad, "architectures": ["Qwen3ForCausalLM"]}, "config.json")


def test_sizes():
    """weight_bytes counts every expected tensor once (tied head not doubled); KV bytes are K+V over layers."""
    untied = _cfg(architectures=["Qwen2ForCausalLM"])
    tied = _cfg(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True)
    assert "lm_head.weight" in expected_tensors(untied) and "lm_head.weight" not in expected_tensors(tied)
    assert weight_bytes(untied, torch.bfloat16) - weight_bytes(tied, torch.bfloat16) == 100 * 32 * 2
    numel = sum(torch.Size(s).numel() for s in expected_tensors(untied).values())
    assert weight_bytes(untied, torch.float32) == 4 * numel
    assert kv_bytes_per_token(untied, torch.float16) == 2 * 2 * 2 * 8 * 2
