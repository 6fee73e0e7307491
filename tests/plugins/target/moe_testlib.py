"""Tiny random-weight transformers Qwen3-MoE models for the MoE target tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

VOCAB = 320
MASK_ID, DFLASH_BLOCK = 300, 6
NUM_EXPERTS, TOP_K = 48, 4  # 2 MoE layers x 48 = 96 experts: a tenth (9) still holds top-k per layer


def build_hf_moe(seed: int = 0, layers: int = 2, mlp_only_layers=(), norm_topk_prob: bool = True,
                 experts: int = NUM_EXPERTS, top_k: int = TOP_K) -> transformers.Qwen3MoeForCausalLM:
    """A hidden-64 Qwen3-MoE whose weights are spread out so greedy argmaxes and routing are not near ties."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=experts,
        num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob, num_hidden_layers=layers,
        mlp_only_layers=list(mlp_only_layers), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=gen) / 8)
    return model


def save_hf_moe(model, path: Path) -> Path:
    """save_pretrained with safetensors (transformers 5 writes per-expert tensors, as Hub checkpoints hold)."""
    model.save_pretrained(path, safe_serialization=True)
    return path


def moe_dflash_pair(root: Path, eps: float = 0.3, c: float = 5.0) -> tuple[Path, Path]:
    """A 4-layer MoE target and a random DFlash drafter that agree at times (the dflash tests' construction).

    Layers are damped by `eps` so hidden states stay near the embedding; the target's head row
    for the mask id points along the normed mask embedding, so its greedy path falls into the
    mask id at times and the drafter, which proposes it, is then accepted.
    """
    from dflash.model import DFlashDraftModel

    tgt = build_hf_moe(seed=7, layers=4, mlp_only_layers=(0,), experts=16, top_k=4)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, rms_norm_eps=1e-6)
    cfg.block_size, cfg.num_target_layers = DFLASH_BLOCK, 4
    cfg.dflash_config = {"mask_token_id": MASK_ID, "target_layer_ids": [1, 2]}
    torch.manual_seed(0)
    ref = DFlashDraftModel(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in ref.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if p.dim() == 1
                    else torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        for m in (tgt.model, ref):
            for layer in m.layers:
                layer.self_attn.o_proj.weight.mul_(eps)
                down = layer.mlp.experts.down_proj if hasattr(layer.mlp, "experts") else layer.mlp.down_proj.weight
                down.mul_(eps)
        ref.norm.weight.copy_(tgt.model.norm.weight)
        u = tgt.model.norm.weight * tgt.model.embed_tokens.weight[MASK_ID]
        tgt.lm_head.weight[MASK_ID] = c * u / u.norm()
    tgt.save_pretrained(root / "target", safe_serialization=True)
    ref.save_pretrained(root / "drafter", safe_serialization=True)
    return root / "target", root / "drafter"


def write_moe_graph(path: Path, target: Path, drafter: Path | None, expert_cache: int = 0,
                    vram_budget: int | None = None) -> Path:
    """target (+ dflash) + verifier graph YAML with the expert cache pinned (or autosized) and an optional budget."""
    taps = "tap_layers: [1, 2], " if drafter else ""
    text = (f"name: moe-test\nnum_draft: {DFLASH_BLOCK - 1}\nmax_context: 128\n"
            + (f"vram_budget: {vram_budget}\n" if vram_budget else "") + "nodes:\n"
            f"  target: {{plugin: target, params: {{path: {target}, {taps}expert_cache: {expert_cache}}}}}\n"
            + (f"  drafter: {{plugin: dflash, params: {{path: {drafter}}}}}\n" if drafter else "")
            + "  verify: {plugin: verifier}\n")
    path.write_text(text)
    return path
