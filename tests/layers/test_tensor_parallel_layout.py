"""The tensor-parallel layout without processes: local configs, which slice of each tensor a rank reads, the check."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftflow.layers.config import TargetConfig, expected_tensors
from draftflow.layers.tensor_parallel import divisibility_problems, local_config, shard_of, take
from draftflow.tools.tiny_model import hf_config, hybrid_config


def _config(hybrid: bool = False, **changes) -> TargetConfig:
    d = (hybrid_config if hybrid else hf_config)(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=48,
                                                 context=128)
    return TargetConfig.from_hf_dict({**d, **changes}, "test")


def test_local_config_divides_the_split_counts_and_keeps_the_bias_on_rank_0():
    """Each rank builds half the heads and MLP width; o_proj's bias (added once after the all-reduce) is rank 0's."""
    cfg = _config(attention_bias=True)
    r0, r1 = local_config(cfg, 2, 0), local_config(cfg, 2, 1)
    assert (r0.num_heads, r0.num_kv_heads, r0.intermediate_size, r0.hidden_size, r0.vocab_size) == (2, 1, 24, 32, 64)
    assert r0.o_bias and not r1.o_bias
    assert "model.layers.0.self_attn.o_proj.bias" not in expected_tensors(r1)
    assert local_config(cfg, 1) is cfg


def test_each_rank_reads_its_rows_or_columns():
    """Column-parallel weights split rows, row-parallel ones columns, norms and the embedding are whole."""
    cfg = _config()
    full, local = expected_tensors(cfg), expected_tensors(local_config(cfg, 2, 1))

    def pieces(name):
        return shard_of(name, full[name], local[name], cfg, rank=1, size=2)

    assert pieces("model.layers.0.self_attn.q_proj.weight") == [(0, 16, 32)]  # heads 2, 3 of 4 (head_dim 8)
    assert pieces("model.layers.0.self_attn.k_proj.weight") == [(0, 8, 16)]  # KV head 1 of 2
    assert pieces("model.layers.0.self_attn.o_proj.weight") == [(1, 16, 32)]
    assert pieces("model.layers.0.mlp.down_proj.weight") == [(1, 24, 48)]
    assert pieces("model.layers.0.input_layernorm.weight") == pieces("model.embed_tokens.weight") == []


def test_gated_deltanet_conv_takes_its_q_k_and_v_channels():
    """A Gated DeltaNet conv's channels are [q | k | v] over all heads: a rank takes its part of each."""
    cfg = _config(hybrid=True)
    name = "model.layers.0.linear_attn.conv1d.weight"
    full, local = expected_tensors(cfg)[name], expected_tensors(local_config(cfg, 2, 0))[name]
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    assert shard_of(name, full, local, cfg, 0, 2) == [(0, 0, key // 2), (0, key, key + key // 2),
                                                       (0, 2 * key, 2 * key + value // 2)]


def test_take_reads_a_safetensors_slice(tmp_path):
    """The pieces read through safetensors' get_slice equal the same slices of the whole tensor."""
    weight = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    save_file({"w": weight}, tmp_path / "m.safetensors")
    pieces = [(1, 2, 4), (1, 6, 8)]
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        part = take(f.get_slice("w"), pieces)
    assert torch.equal(part, torch.cat([weight[:, 2:4], weight[:, 6:8]], dim=1))
    assert torch.equal(take(weight, [(0, 3, 6)]), weight[3:6]) and take(weight, [(0, 3, 6)])._base is None


def test_divisibility_problems_name_each_count_and_the_sizes_that_work():
    """tensor_parallel 4 over 2 KV heads: one problem, naming the field and the sizes that divide every count."""
    problems = divisibility_problems(_config(), 4)
    assert problems == [("KV heads (num_key_value_heads) = 2 is not divisible by tensor_parallel 4",
                         "use a tensor_parallel that divides every split count of this model (1, 2)")]
    assert divisibility_problems(_config(), 2) == []
