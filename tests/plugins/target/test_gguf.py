"""HF -> GGUF converter and GGUF loader round trips."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from target_testlib import LLAMA3_ROPE, VOCAB
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from draftflow.plugins.target.gguf_loader import PRE_TOKENIZER_REGEX, load_gguf, read_gguf_config
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.layers.kv_cache import KVCache
from draftflow.tools.convert_gguf import convert_hf_to_gguf, main

CASES = {
    "qwen3": ("qwen3", {}),
    "llama": ("llama", {"kv_heads": 1}),
    "llama-llama3rope-tied": ("llama", {"rope": LLAMA3_ROPE, "tied": True}),
    "qwen2-tied": ("qwen2", {"tied": True}),
}
TOKENS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(11))  # [2, 20]


def _logits(loaded, dtype=torch.float32) -> torch.Tensor:
    cache = KVCache.growing(loaded.config, 2, 32, dtype, "cpu")
    return loaded.model(TOKENS, 0, cache)[0]  # [2, 20, V]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_round_trip_is_exact(hf_dir, tmp_path, case, dtype):
    """F32 and BF16 GGUF files load to exactly the logits of the HF directory loaded in the same dtype."""
    arch, kwargs = CASES[case]
    _, path = hf_dir(arch, **kwargs)
    torch_dtype = torch.float32 if dtype == "f32" else torch.bfloat16
    convert_hf_to_gguf(path, tmp_path / "m.gguf", dtype)
    from_gguf = load_gguf(tmp_path / "m.gguf", "cpu", torch_dtype)
    from_hf = load_hf(path, "cpu", torch_dtype)
    assert from_gguf.config.tie_word_embeddings == from_hf.config.tie_word_embeddings
    assert torch.equal(_logits(from_gguf, torch_dtype), _logits(from_hf, torch_dtype))
    assert from_gguf.eos_ids == (2,)


@pytest.mark.parametrize("case", CASES)
def test_q8_0_dequantizes_like_gguf_and_stays_close(hf_dir, tmp_path, case):
    """Q8_0 weights equal gguf's own dequantize exactly; logits stay within quantization error."""
    arch, kwargs = CASES[case]
    _, path = hf_dir(arch, **kwargs)
    convert_hf_to_gguf(path, tmp_path / "m.gguf", "q8_0")
    loaded = load_gguf(tmp_path / "m.gguf", "cpu", torch.float32)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    ffn = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    assert ffn.tensor_type == gguf.GGMLQuantizationType.Q8_0
    want = torch.from_numpy(gguf.dequantize(ffn.data, ffn.tensor_type))
    assert torch.equal(loaded.model.layers[1].mlp.down_proj.weight, want)
    ref = _logits(load_hf(path, "cpu", torch.float32))
    # Random weights amplify the 0.4% per-weight error through two layers; 2-4% is typical here.
    assert ((_logits(loaded) - ref).abs().max() / ref.abs().max()).item() < 6e-2
    assert ((_logits(loaded) - ref).norm() / ref.norm()).item() < 3e-2


def test_llama_q_k_are_stored_in_llama_cpp_layout(hf_dir, tmp_path):
    """attn_q of a llama GGUF holds llama.cpp's interleaved rows, not HF's half-split rows."""
    hf, path = hf_dir("llama", kv_heads=2)
    convert_hf_to_gguf(path, tmp_path / "m.gguf", "f32")
    q = next(t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors if t.name == "blk.0.attn_q.weight")
    stored = np.asarray(q.data)  # [H*D, hidden]
    hf_q = hf.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    d = 16
    # llama.cpp rotates adjacent pairs (0,1), (2,3)...; HF rotates (i, i + d/2).
    assert np.array_equal(stored[0], hf_q[0]) and np.array_equal(stored[1], hf_q[d // 2])
    assert np.array_equal(stored[2], hf_q[1]) and np.array_equal(stored[d + 1], hf_q[d + d // 2])


def test_read_gguf_config_matches_hf(hf_dir, tmp_path):
    """Metadata written by the converter reproduces the HF config fields."""
    _, path = hf_dir("qwen3", kv_heads=1)
    convert_hf_to_gguf(path, tmp_path / "m.gguf", "f16")
    got, want = read_gguf_config(tmp_path / "m.gguf"), load_hf(path, "cpu", torch.float32).config
    for field in ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rope_theta", "max_position_embeddings", "qk_norm", "bos_token_id"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)


def _byte_level_bpe(pre: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if pre == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the cat sat on the mat", "speculative decoding is lossless 12345"] * 20, trainer)
    return tok


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2"])
def test_embedded_tokenizer_round_trips(hf_dir, tmp_path, pre):
    """A byte-level BPE tokenizer.json is embedded and rebuilt with identical encodings and decoding."""
    _, path = hf_dir("qwen2")
    original = _byte_level_bpe(pre)
    original.save(str(path / "tokenizer.json"))
    assert main([str(path), str(tmp_path / "m.gguf"), "--dtype", "q8_0"]) == 0
    rebuilt = load_gguf(tmp_path / "m.gguf", "cpu", torch.float32).tokenizer
    assert rebuilt is not None
    for text in ["the cat sat", "Lossless  decoding 2026!\n<|endoftext|>", "naïve café ü"]:
        ids = original.encode(text).ids
        assert rebuilt.encode(text).ids == ids
        assert rebuilt.decode(ids) == original.decode(ids)
