"""Helpers for the hybrid (Qwen3-Next) target tests: a tiny random transformers reference model.

Lives at the tests root (on sys.path via tests/conftest.py) so the target and dflash folders share it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from draftflow.plugins.target.kv_cache import KVCache
from draftflow.plugins.target.linear_state import LinearState

VOCAB = 320
# linear, full, linear, linear: taps and rollback cross both kinds; GVA (2 key heads, 4 value heads).
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
HYBRID_KW = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0,
                 layer_types=LAYER_TYPES, max_position_embeddings=256, tie_word_embeddings=False,
                 bos_token_id=1, eos_token_id=2)


def build_hybrid(seed: int = 0, head_scale: float = 1.0, **overrides) -> transformers.Qwen3NextForCausalLM:
    """A random fp32 Qwen3-Next with O(1) activations: (1+w) norms near 1, decays that forget over a few tokens."""
    cfg = transformers.Qwen3NextConfig(**{**HYBRID_KW, **overrides})
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen))
            elif p.dim() == 1:
                offset = name.endswith("dt_bias") or ".linear_attn.norm." in name  # plain (w) weights
                p.copy_(float(offset) + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
        model.lm_head.weight.mul_(head_scale)
    return model


def save(model: transformers.PreTrainedModel, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def fresh_states(loaded, tokens: list[int]) -> LinearState:
    """The Gated DeltaNet states after prefilling `tokens` in one fresh forward (the rollback oracle)."""
    cfg = loaded.config
    state = LinearState.allocate(cfg, 1, 1, torch.float32, "cpu")
    cache = KVCache.growing(cfg, 1, len(tokens) + 1, torch.float32, "cpu")
    with torch.inference_mode():
        loaded.model(torch.tensor([tokens]), 0, cache, logit_rows=1, linear=state)
    state.commit(len(tokens))
    return state
