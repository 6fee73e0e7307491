"""Helpers for the dflash2 tests: tiny random DFlash2DraftModel references, targets, graph files.

Built on dflash_testlib (same tiny backbone shapes); a uniquely named module, not conftest.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from dflash.model import DFlash2DraftModel
from dflash_testlib import BLOCK, DRAFT_KW, MASK_ID, TAPS, VOCAB, save_reference, spread
from safetensors.torch import load_file, save_file

__all__ = ["BLOCK", "MASK_ID", "TAPS", "VOCAB", "build_reference2", "build_target", "save_reference", "write_graph"]
EXTRAS = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8)


def build_reference2(seed: int = 0, vocab: int = VOCAB, mask_id: int = MASK_ID, config_attrs=None, **extra):
    """The z-lab DFlash2 reference with random unit-scale weights; `extra` goes into dflash_config."""
    cfg = transformers.Qwen3Config(**{**DRAFT_KW, "vocab_size": vocab})
    cfg.block_size = BLOCK
    cfg.num_target_layers = 4
    cfg.dflash_config = {"mask_token_id": mask_id, "target_layer_ids": list(TAPS), **EXTRAS, **extra}
    for key, value in (config_attrs or {}).items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = DFlash2DraftModel(cfg).eval()
    spread(model, seed + 1)
    return model


def build_target(seed: int = 7, vocab: int = VOCAB, head_scale: float = 8.0) -> transformers.Qwen3ForCausalLM:
    """A 4-layer hidden-64 Qwen3 target with untied head (vocabulary `vocab`)."""
    cfg = transformers.Qwen3Config(**{**DRAFT_KW, "num_hidden_layers": 4, "vocab_size": vocab},
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    spread(model, seed + 1)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def soften_convs(model, conv_scale: float = 0.1) -> None:
    """Convolutions near identity (tap 0 ~ 1, small rest) so the drafter stays close to its backbone."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                base = conv_scale * torch.randn(conv.base_kernel.shape, generator=gen)
                base[:, 0] += 1.0
                conv.base_kernel.copy_(base)
                conv.kernel_projection.weight.mul_(conv_scale)


def agreeing_pair2(root: Path, eps: float = 0.3, c: float = 5.0, codebook_scale: float = 1.0) -> tuple[Path, Path]:
    """A target and a DFlash2 drafter that agree often but not always (see dflash_testlib.agreeing_pair)."""
    tgt, ref = build_target(head_scale=1.0), build_reference2()
    soften_convs(ref)
    with torch.no_grad():
        for m in (tgt.model, ref):
            for layer in m.layers:
                layer.self_attn.o_proj.weight.mul_(eps)
                layer.mlp.down_proj.weight.mul_(eps)
        ref.norm.weight.copy_(tgt.model.norm.weight)
        u = tgt.model.norm.weight * tgt.model.embed_tokens.weight[MASK_ID]
        tgt.lm_head.weight[MASK_ID] = c * u / u.norm()
        ref.candidate_selector.successor_codebook.weight.mul_(codebook_scale)
    tgt.save_pretrained(root / "target", safe_serialization=True)
    save_reference(ref, root / "drafter")
    return root / "target", root / "drafter"


def bare_codebooks(path: Path) -> None:
    """Rename the codebooks to the published checkpoint spelling (no `.weight`)."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    for side in ("predecessor", "successor"):
        tensors[f"candidate_selector.{side}_codebook"] = tensors.pop(f"candidate_selector.{side}_codebook.weight")
    save_file(tensors, file)


def edit_config(path: Path, **changes) -> None:
    """Change top-level keys (None removes) and `dflash_config` keys given as dflash_<key>."""
    file = path / "config.json"
    d = json.loads(file.read_text())
    for key, value in changes.items():
        where, key = (d["dflash_config"], key.removeprefix("dflash_")) if key.startswith("dflash_") else (d, key)
        if value is None:
            where.pop(key, None)
        else:
            where[key] = value
    file.write_text(json.dumps(d))


def write_graph(path: Path, target: Path, drafter: Path, selector: str = "dflash2-selector", tap_layers=TAPS,
                kv_mode: str = "static", num_draft: int = BLOCK - 1) -> Path:
    """A target + dflash2 + selector + verifier graph YAML (edges auto-wired)."""
    path.write_text(
        f"name: dflash2-test\nnum_draft: {num_draft}\nmax_context: 128\nnodes:\n"
        f"  target: {{plugin: target, params: {{path: {target}, tap_layers: {list(tap_layers)}, kv_mode: {kv_mode}}}}}\n"
        f"  drafter: {{plugin: dflash2, params: {{path: {drafter}}}}}\n"
        f"  selector: {{plugin: {selector}}}\n"
        "  verify: {plugin: verifier}\n")
    return path
