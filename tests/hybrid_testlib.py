"""Helpers for the hybrid (Qwen3-Next) target tests: a tiny random transformers reference model.

Lives at the tests root (on sys.path via tests/conftest.py) so the target and dflash folders share it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from draftflow.layers.kv_cache import KVCache
from draftflow.layers.linear_state import LinearState

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


# --- Qwen3-Next MTP heads (transformers drops `mtp.*` on load and never writes it, so tests add them) ---


def build_mtp_layer(config, seed: int = 0, out_scale: float = 1.0):
    """A random transformers full-attention decoder layer of `config` (gated attention, MoE if the config has
    experts): the block of a Qwen3-Next MTP head and its independent reference. `out_scale` scales what the
    layer adds to the residual (o_proj and every down_proj)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    torch.manual_seed(seed)
    layer = Qwen3NextDecoderLayer(config, config.layer_types.index("full_attention")).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() == 1:  # every norm of the block is x̂·(1+w)
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(out_scale)
    return layer


def mtp_tensors(layer, fc: torch.Tensor, norm_e: torch.Tensor, norm_h: torch.Tensor, norm: torch.Tensor) -> dict:
    """Checkpoint names -> tensors of a Qwen3-Next MTP head, experts per expert as Hub checkpoints store them."""
    out = {"mtp.fc.weight": fc, "mtp.pre_fc_norm_embedding.weight": norm_e, "mtp.pre_fc_norm_hidden.weight": norm_h,
           "mtp.norm.weight": norm}
    for name, p in layer.state_dict().items():
        if name == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            half = p.shape[1] // 2
            for j in range(p.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{j}.gate_proj.weight"] = p[j, :half]
                out[f"mtp.layers.0.mlp.experts.{j}.up_proj.weight"] = p[j, half:]
        elif name == "mlp.experts.down_proj":  # [E, H, I]
            for j in range(p.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{j}.down_proj.weight"] = p[j]
        else:
            out["mtp.layers.0." + name] = p
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def add_mtp(path: Path, tensors: dict) -> Path:
    """Append MTP tensors to a saved checkpoint's model.safetensors and declare them (`mtp_num_hidden_layers`)."""
    import json

    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    save_file({**weights, **tensors}, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return path
