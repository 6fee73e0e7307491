"""Tiny random-weight HF models saved with save_pretrained, for parity and loader tests.

A uniquely named module (not conftest) so that importing it from test files never picks up
another folder's conftest when several test folders run in one pytest call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB = 320  # > 256 so a byte-level BPE tokenizer with a few merges fits
_CLASSES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # small, so all three frequency bands occur at head_dim 16
}


def build_hf_model(
    arch: str,
    tied: bool = False,
    kv_heads: int = 2,
    rope: dict[str, Any] | None = None,
    seed: int = 0,
) -> transformers.PreTrainedModel:
    """A 2-layer, hidden-64 model whose weights are spread out so greedy argmaxes are not near ties."""
    config_cls, model_cls = _CLASSES[arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    if rope is not None:
        kwargs["rope_parameters"] = rope
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        if not tied:
            # An untied head must differ from the embedding for the test to prove it is used.
            model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=gen) / 8)
    return model


def save_hf_model(model: transformers.PreTrainedModel, path: Path, **kwargs: Any) -> Path:
    """save_pretrained with safetensors, as users' checkpoints arrive."""
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def hf_greedy(hf, prompt: torch.Tensor, steps: int) -> list[int]:
    """Greedy continuation through transformers with a DynamicCache, one token per forward."""
    from transformers import DynamicCache

    cache, ids, out = DynamicCache(), prompt, []
    with torch.no_grad():
        for _ in range(steps):
            ids = hf(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            out.append(int(ids))
    return out


def our_greedy(model, cfg, prompt: torch.Tensor, steps: int) -> list[int]:
    """Greedy continuation through our TargetModel over a growing float32 KV cache on the CPU."""
    from draftflow.layers.kv_cache import KVCache

    cache = KVCache.growing(cfg, 1, 256, torch.float32, "cpu", chunk_tokens=16)
    ids, pos, out = prompt, 0, []
    for _ in range(steps):
        logits, _ = model(ids, pos, cache, logit_rows=1)
        pos += ids.shape[1]
        cache.commit(pos)
        ids = logits.argmax(-1)
        out.append(int(ids))
    return out
