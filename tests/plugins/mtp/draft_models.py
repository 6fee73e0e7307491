"""Tiny random targets (transformers, save_pretrained) and MTP heads for drafter tests.

Shared by the lookup, mixer and mtp test folders (their conftests put this folder on
sys.path). ``mimic_mtp`` builds an MTP head that re-runs a one-layer target on the
shifted sequence, so its drafts are usually right and the greedy gate exercises
acceptance, KV reuse and rollback, not only rejection.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers
from helpers import spread_weights
from safetensors.torch import save_file

VOCAB = 320
_CLASSES = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}
# Our module-free names of the block, relative to the layout's block prefix.
BLOCK = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
         "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def build_target(arch: str = "qwen3", layers: int = 1, seed: int = 0, cycle: int = 0,
                 layer_scale: float = 1.0) -> transformers.PreTrainedModel:
    """A hidden-64 random model with spread weights and unit-RMS embedding rows.

    ``cycle`` > 0 aims the LM head at a permutation of the vocabulary made of cycles of that
    length and ``layer_scale`` shrinks what the layers add to the residual, so greedy text
    mostly repeats with period ``cycle`` (with the layers still able to break the pattern).
    """
    config_cls, model_cls = _CLASSES[arch]
    cfg = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    spread_weights(model, gen)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(emb / emb.pow(2).mean(-1, keepdim=True).sqrt())  # unit RMS: rmsnorm(e) == e
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=gen) / 8)
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(layer_scale)
        if cycle:
            order = torch.randperm(VOCAB, generator=gen)
            nxt = torch.empty(VOCAB, dtype=torch.long)
            for c in range(0, VOCAB - VOCAB % cycle, cycle):
                ids = order[c:c + cycle]
                nxt[ids] = ids.roll(-1)
            rest = order[VOCAB - VOCAB % cycle:]
            nxt[rest] = rest.roll(-1)
            model.lm_head.weight.copy_(emb[torch.argsort(nxt)] / 4)  # head row j = Emb(t) where nxt[t] = j
    return model


def save_target(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def _names(layout: str, num_layers: int) -> tuple[dict, str]:
    if layout == "deepseek-v3":
        p = f"model.layers.{num_layers}."
        return {"norm_e": p + "enorm.weight", "norm_h": p + "hnorm.weight", "proj": p + "eh_proj.weight",
                "out_norm": p + "shared_head.norm.weight", "head": p + "shared_head.head.weight"}, p
    return {"norm_e": "mtp.pre_fc_norm_embedding.weight", "norm_h": "mtp.pre_fc_norm_hidden.weight",
            "proj": "mtp.fc.weight", "out_norm": "mtp.norm.weight"}, "mtp.layers.0."


def random_mtp(cfg, layout: str, seed: int = 7) -> dict[str, torch.Tensor]:
    """Random MTP weights in the checkpoint naming of ``layout`` (norm weights spread around their identity)."""
    gen = torch.Generator().manual_seed(seed)
    h, q, kv, inter = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    base = 0.0 if layout == "qwen3-next" else 1.0  # x̂·(1+w) has identity at w = 0
    shapes = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (cfg.head_dim,),
              "self_attn.k_norm.weight": (cfg.head_dim,), "post_attention_layernorm.weight": (h,),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    if cfg.model_type == "llama":
        shapes = {k: v for k, v in shapes.items() if "q_norm" not in k and "k_norm" not in k}
    heads, block = _names(layout, cfg.num_hidden_layers)
    out = {}
    for name, shape in shapes.items():
        out[block + name] = (base + 0.3 * torch.randn(shape, generator=gen)) if len(shape) == 1 else \
            torch.randn(shape, generator=gen) / shape[1] ** 0.5
    for key in ("norm_e", "norm_h", "out_norm"):
        out[heads[key]] = base + 0.3 * torch.randn(h, generator=gen)
    out[heads["proj"]] = torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5
    if "head" in heads:
        out[heads["head"]] = torch.randn(cfg.vocab_size, h, generator=gen) / 8
    return out


def mimic_mtp(model, layout: str, hidden_mix: float = 0.02, seed: int = 3) -> dict[str, torch.Tensor]:
    """MTP weights whose block is the one-layer target's layer fed the token embedding (plus a little h)."""
    cfg = model.config
    assert cfg.num_hidden_layers == 1
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shift = -1.0 if layout == "qwen3-next" else 0.0  # store w - 1 where the layout computes x̂·(1+w)
    heads, block = _names(layout, 1)
    out = {}
    for name in BLOCK:
        src = "model.layers.0." + name
        if src in sd:
            out[block + name] = sd[src] + (shift if sd[src].dim() == 1 else 0.0)
    h = cfg.hidden_size
    gen = torch.Generator().manual_seed(seed)
    proj = torch.zeros(h, 2 * h)
    proj[:, :h] = torch.eye(h)  # embedding half: identity, so x = Emb(t) as in the target
    proj[:, h:] = hidden_mix * torch.randn(h, h, generator=gen) / h ** 0.5
    out[heads["proj"]] = proj
    out[heads["norm_e"]] = torch.full((h,), 1.0 + shift)
    out[heads["norm_h"]] = torch.full((h,), 1.0 + shift)
    out[heads["out_norm"]] = sd["model.norm.weight"] + shift
    if "head" in heads:
        out[heads["head"]] = sd["lm_head.weight"]
    return out


def save_mtp(state: dict, target_dir: Path, out_dir: Path) -> Path:
    """A standalone MTP directory: model.safetensors with the head + the target's config.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"))
    shutil.copy(target_dir / "config.json", out_dir / "config.json")
    return out_dir
