"""Parity of TargetModel (loaded from save_pretrained directories) with transformers."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close_to_scale, scaled_error, tiny_model_bound
from target_testlib import LLAMA3_ROPE, VOCAB, hf_greedy, our_greedy

from draftflow.plugins.target.hf_loader import load_hf
from draftflow.layers.kv_cache import KVCache

CASES = {
    "qwen3-untied-gqa2": ("qwen3", {"kv_heads": 2}),
    "qwen3-tied-mha": ("qwen3", {"tied": True, "kv_heads": 4}),
    "llama-plain-gqa4": ("llama", {"kv_heads": 1}),
    "llama-llama3rope-tied": ("llama", {"rope": LLAMA3_ROPE, "tied": True, "kv_heads": 2}),
    "llama-llama3rope-untied-mha": ("llama", {"rope": LLAMA3_ROPE, "kv_heads": 4}),
    "qwen2-bias-tied-gqa2": ("qwen2", {"tied": True, "kv_heads": 2}),
    "qwen2-bias-untied-gqa4": ("qwen2", {"kv_heads": 1}),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_taps_and_greedy_match_transformers(hf_dir, case):
    """Logits (1e-4 of scale), taps = hidden_states[L+1] and 64-token greedy runs match transformers."""
    arch, kwargs = CASES[case]
    hf, path = hf_dir(arch, **kwargs)
    loaded = load_hf(path, "cpu", torch.float32)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(tokens, output_hidden_states=True)
    cache = KVCache.growing(loaded.config, 2, 64, torch.float32, "cpu")
    logits, taps = loaded.model(tokens, 0, cache, tap_layers=(1, 0))
    assert scaled_error(logits, ref.logits) <= 1e-4
    assert_close_to_scale(taps[..., :64], ref.hidden_states[2], tiny_model_bound(2), "layer-1 taps")
    assert_close_to_scale(taps[..., 64:], ref.hidden_states[1], tiny_model_bound(2), "layer-0 taps")

    prompt = tokens[:1, :8]
    assert our_greedy(loaded.model, loaded.config, prompt, 64) == hf_greedy(hf, prompt, 64)


def test_llama3_rope_scaling_changes_the_model(hf_dir):
    """The llama3 RoPE case is meaningful: scaled and plain configs give different logits."""
    hf, path = hf_dir("llama", rope=LLAMA3_ROPE)
    scaled = load_hf(path, "cpu", torch.float32)
    assert scaled.config.rope_scaling is not None
    plain_hf, plain_path = hf_dir("llama")
    plain = load_hf(plain_path, "cpu", torch.float32)
    tokens = torch.arange(60)[None] % VOCAB
    a, _ = scaled.model(tokens, 0, KVCache.growing(scaled.config, 1, 64, torch.float32, "cpu"))
    b, _ = plain.model(tokens, 0, KVCache.growing(plain.config, 1, 64, torch.float32, "cpu"))
    assert scaled_error(a, b) > 1e-3


def test_sharded_checkpoint_loads(hf_dir):
    """A save_pretrained directory split into several shards (index.json) loads and matches transformers."""
    hf, path = hf_dir("qwen2", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("model-*.safetensors"))) > 2
    loaded = load_hf(path, "cpu", torch.float32)
    tokens = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(tokens).logits
    logits, taps = loaded.model(tokens, 0, KVCache.growing(loaded.config, 1, 16, torch.float32, "cpu"))
    assert taps is None
    assert scaled_error(logits, ref) <= 1e-4


def test_generation_config_eos_list_is_used(hf_dir):
    """eos_token_id given as a list in generation_config.json becomes the eos_ids tuple."""
    hf, path = hf_dir("qwen3")
    (path / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    assert load_hf(path, "cpu", torch.float32).eos_ids == (2, 7)
    (path / "generation_config.json").unlink()
    assert load_hf(path, "cpu", torch.float32).eos_ids == (2,)


def test_progress_bar_only_for_big_loads_on_a_tty(monkeypatch, capsys):
    """The stderr progress bar draws only when stderr is a TTY and the load exceeds 256 MiB."""
    from draftflow.plugins.target import hf_loader

    monkeypatch.setattr(hf_loader.sys.stderr, "isatty", lambda: True, raising=False)
    small = hf_loader._Progress(1 << 20, "loading small")
    small.update(1 << 20)
    small.close()
    big = hf_loader._Progress(1 << 30, "loading big")
    big.update(1 << 29)
    big.close()
    err = capsys.readouterr().err
    assert "loading small" not in err
    assert "loading big [###############               ]  50.0% (0.50/1.00 GiB)" in err
