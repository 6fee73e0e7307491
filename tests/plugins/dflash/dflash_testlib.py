"""Helpers for the dflash tests: tiny random reference drafters, a 4-layer Qwen3 target, graph files.

A uniquely named module (not conftest) so `from conftest import` in other test folders cannot shadow it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from helpers import spread_weights
from dflash.model import DFlashDraftModel

VOCAB = 320
MASK_ID = 300
TAPS = [1, 2]
BLOCK = 6
DRAFT_KW = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)


def spread(model: torch.nn.Module, seed: int) -> None:
    """Weights with unit-scale activations, so argmaxes are not near ties."""
    spread_weights(model, torch.Generator().manual_seed(seed))


def build_reference(seed: int = 0, taps=TAPS, **extra) -> DFlashDraftModel:
    """The z-lab reference drafter with random weights."""
    cfg = transformers.Qwen3Config(**DRAFT_KW)
    cfg.block_size = BLOCK
    cfg.num_target_layers = 4
    cfg.dflash_config = {"mask_token_id": MASK_ID, "target_layer_ids": list(taps), **extra}
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg).eval()
    spread(model, seed + 1)
    return model


def save_reference(model: DFlashDraftModel, path: Path, dtype: torch.dtype = torch.float32) -> Path:
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    model.float()
    return path


def build_target(seed: int = 7, layers: int = 4) -> transformers.Qwen3ForCausalLM:
    """A 4-layer hidden-64 Qwen3 target with untied head."""
    cfg = transformers.Qwen3Config(**{**DRAFT_KW, "num_hidden_layers": layers}, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    spread(model, seed + 1)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked target distributions: greedy runs are stable
    return model


def edit_config(path: Path, **changes) -> None:
    file = path / "config.json"
    d = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            d.pop(key, None)
        else:
            d[key] = value
    file.write_text(json.dumps(d))


def agreeing_pair(root: Path, eps: float = 0.3, c: float = 5.0) -> tuple[Path, Path]:
    """Save a target and a drafter that agree often but not always (mixed acceptance), return their dirs.

    Both models' layers are damped by `eps` so the block output stays close to the mask
    embedding; the target's head row for the mask id points along the drafter's normed
    mask embedding, so the target's greedy path falls into the mask id at times and the
    drafter, which proposes it, is then accepted.
    """
    tgt, ref = build_target(), build_reference()
    with torch.no_grad():
        tgt.lm_head.weight.div_(8)
        for m in (tgt.model, ref):
            for layer in m.layers:
                layer.self_attn.o_proj.weight.mul_(eps)
                layer.mlp.down_proj.weight.mul_(eps)
        ref.norm.weight.copy_(tgt.model.norm.weight)
        u = tgt.model.norm.weight * tgt.model.embed_tokens.weight[MASK_ID]
        tgt.lm_head.weight[MASK_ID] = c * u / u.norm()
    tgt.save_pretrained(root / "target", safe_serialization=True)
    save_reference(ref, root / "drafter")
    return root / "target", root / "drafter"


def write_graph(path: Path, target: Path, drafter: Path, tap_layers=TAPS, kv_mode: str = "static",
                num_draft: int = BLOCK - 1) -> Path:
    """A target + dflash + verifier graph YAML (edges auto-wired)."""
    path.write_text(
        f"name: dflash-test\nnum_draft: {num_draft}\nmax_context: 128\nnodes:\n"
        f"  target: {{plugin: target, params: {{path: {target}, tap_layers: {list(tap_layers)}, kv_mode: {kv_mode}}}}}\n"
        f"  drafter: {{plugin: dflash, params: {{path: {drafter}}}}}\n"
        "  verify: {plugin: verifier}\n")
    return path
