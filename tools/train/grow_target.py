"""Grow a trained Qwen3/Llama target deeper without changing what it computes, and move its drafters' taps along.

New decoder layers are inserted between the trained ones, spread evenly, as identity blocks: their attention output
projection and MLP down projection start at zero, so each adds nothing to the residual stream until training moves
those weights (the other projections start random, as a fresh layer's). The grown model's logits equal the trained
one's to rounding, and every hidden state of an old layer is found again at its new index; so a DFlash or DFlash2
drafter trained on the old target keeps working on the grown one once its `target_layer_ids` name the new indices
(`retap_drafter`). An MTP head reads only the last hidden state and needs no change of taps, but its DeepSeek-V3 file
names its block by the target's depth: train it again on the grown target.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftflow.core.errors import DraftflowError
from draftflow.layers.config import TargetConfig
from draftflow.plugins.target.model import TargetModel
from draftflow.tools.train.loop import init_weights

# The projections that write a layer's output into the residual stream: zero, the layer is an identity.
OUTPUT_PROJECTIONS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def layer_map(old: int, new: int) -> list[int | None]:
    """For each layer of the grown model, the trained layer it copies (None: inserted). The `new - old` inserted
    layers go before the trained layers round((j+1) * old / (new-old+1)), j = 0.., spreading them evenly."""
    if new < old:
        raise DraftflowError(f"grow to {new} layers: fewer than the trained target's {old}; pick at least {old}")
    added = new - old
    before = [round((j + 1) * old / (added + 1)) for j in range(added)]
    out: list[int | None] = []
    for i in range(old):
        out += [None] * before.count(i) + [i]
    return out + [None] * before.count(old)  # rounded up past the last trained layer


def grow_target(folder: str | Path, num_layers: int, seed: int = 0) -> tuple[TargetModel, dict, list[int | None]]:
    """The target in `folder` (config.json + model.safetensors), grown to `num_layers` decoder layers, float32 and
    trainable; with its grown Hugging Face config and the layer map (new index -> trained index or None)."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
        state = load_file(str(folder / "model.safetensors"))
    except (OSError, ValueError) as exc:
        raise DraftflowError(f"grow from {folder}: {exc}; give a folder with config.json and one "
                             "model.safetensors") from None
    mapping = layer_map(int(config["num_hidden_layers"]), num_layers)
    config = dict(config, num_hidden_layers=num_layers)
    model = TargetModel(TargetConfig.from_hf_dict(config, f"{folder} grown"))
    init_weights(model, seed=seed)
    state = {name.removeprefix("model."): t for name, t in state.items()}
    grown = {}
    for name, param in model.state_dict().items():
        parts = name.split(".")
        if parts[0] == "layers":
            old = mapping[int(parts[1])]
            rest = ".".join(parts[2:])
            if old is None:
                grown[name] = torch.zeros_like(param) if rest in OUTPUT_PROJECTIONS else param
                continue
            name_old = f"layers.{old}.{rest}"
        else:
            name_old = name
        if name_old not in state:
            raise DraftflowError(f"grow from {folder}: no tensor {name_old!r} in model.safetensors; give a dense "
                                 "Qwen3/Llama target")
        grown[name] = state[name_old].float()
    model.load_state_dict(grown)
    return model.requires_grad_(True), config, mapping


def retap_drafter(src: str | Path, dst: str | Path, mapping: list[int | None]) -> list[int]:
    """Copy the DFlash/DFlash2 drafter folder `src` to `dst` (may be the same) with its taps moved to the layers' new
    indices in the grown target; returns the new taps."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    new_index = {old: i for i, old in enumerate(mapping) if old is not None}
    taps = config["dflash_config"]["target_layer_ids"]
    if any(t not in new_index for t in taps):
        raise DraftflowError(f"{src}: taps {taps} do not fit a target of {len(new_index)} layers; use the drafter "
                             "trained on the target being grown")
    config["dflash_config"]["target_layer_ids"] = [new_index[t] for t in taps]
    config["num_target_layers"] = len(mapping)
    if src.resolve() != dst.resolve():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config["dflash_config"]["target_layer_ids"]
