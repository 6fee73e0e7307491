"""Load a Hugging Face checkpoint directory (config.json + safetensors) into a TargetModel.

Everything is checked before any weight is read: the config is parsed, every shard's
header is opened, and the tensor names and shapes are compared with
`expected_tensors(cfg)`. Tensors are then read through safetensors' memory map and
placed straight on the device in the requested dtype.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import torch
from tokenizers import Tokenizer

from draftflow.plugin import ModelFormatError, file_problem, open_safetensors, read_json_object
from draftflow.layers.config import ConfigFields, TargetConfig, expected_tensors, read_config  # noqa: F401 (read_config: re-exported for the target plugin)
from draftflow.plugins.target.model import TargetModel
from draftflow.layers.moe import HostExperts, is_expert_tensor, split_fused_experts
from draftflow.layers.tensor_parallel import SINGLE, TPGroup, shard_of, take

_PROGRESS_MIN_BYTES = 256 << 20
_MAX_LISTED = 5


@attrs.frozen
class LoadedTarget:
    """A loaded target: the model, its config, its tokenizer (or None) and stop tokens."""

    model: TargetModel
    config: TargetConfig
    tokenizer: Tokenizer | None
    eos_ids: tuple[int, ...]
    source: str


def load_hf(path: str | os.PathLike[str], device: torch.device | str, dtype: torch.dtype, tp: TPGroup = SINGLE) -> LoadedTarget:
    """Load config, weights, generation config and tokenizer from an HF directory.

    With a tensor-parallel group `tp` only this rank's shard of each split tensor is read
    (safetensors slices: the other ranks' bytes are never touched).
    """
    root = Path(path)
    cfg = read_config(root)
    shards = _shard_map(root)  # tensor name -> file
    # MoE experts stay on the host, so read everything there and move the rest to the device.
    handles = {file: _open(file, "cpu" if cfg.moe_layers else device) for file in sorted(set(shards.values()))}
    found = {}
    stored = {file: {_canonical(n): n for n in h.keys()} for file, h in handles.items()}
    for name, file in shards.items():
        if name not in stored[file]:
            raise ModelFormatError(
                f"{file}: tensor {name!r} is listed in model.safetensors.index.json but absent from the "
                "shard; expected it there; re-save the checkpoint"
            )
        found[name] = tuple(handles[file].get_slice(stored[file][name]).get_shape())
    mtp = mtp_prefixes(_read_json(root / "config.json", required=True), cfg)
    found = {n: shape for n, shape in found.items() if not n.startswith(mtp)}
    fused = split_fused_experts(found)  # transformers-5 fused experts -> per-expert views
    check_tensors(found, cfg, str(root), {n: str(f) for n, f in shards.items()})

    model = TargetModel(cfg, dtype=dtype, device="meta", tp=tp)
    full, expected = expected_tensors(cfg), expected_tensors(model.config)  # the rank's shapes (tensor_parallel.py)
    wanted = [n for n in expected if n in shards or n in fused]  # drops a tied model's lm_head
    sizes = {n: _numel(expected[n]) * dtype.itemsize for n in wanted}
    progress = _Progress(sum(sizes.values()), f"loading {root.name}")
    state, fused_read = {}, {}
    for name in wanted:
        source, expert, rows = fused.get(name, (name, None, None))
        file = shards[source]
        pieces = shard_of(name, full[name], expected[name], cfg, tp.rank, tp.size)  # [] = the whole tensor
        try:
            if expert is None and pieces:
                tensor = take(handles[file].get_slice(stored[file][source]), pieces)
            elif expert is None:
                tensor = handles[file].get_tensor(stored[file][source])
            else:  # one read per fused tensor, sliced per expert
                if source not in fused_read:
                    fused_read = {source: handles[file].get_tensor(stored[file][source])}
                tensor = fused_read[source][expert, rows]
                tensor = take(tensor, pieces) if pieces else tensor
        except Exception as exc:  # noqa: BLE001 - any read failure means a damaged file
            raise ModelFormatError(
                f"{file}: reading tensor {name!r} failed ({exc}); expected a complete safetensors file; "
                "re-download or re-save the checkpoint"
            ) from exc
        state[_module_name(name)] = tensor.to(device="cpu" if is_expert_tensor(name) else device, dtype=dtype)
        progress.update(sizes[name])
    progress.close()
    if cfg.moe_layers:
        model.host_experts = HostExperts.pop_from_state(state, model.config, pin=torch.device(device).type == "cuda")
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)  # moves the non-persistent RoPE buffer; weights are already there

    gen = _read_json(root / "generation_config.json", required=False)
    eos = ConfigFields(gen, str(root / "generation_config.json")).token_ids("eos_token_id") or cfg.eos_token_ids
    return LoadedTarget(model, cfg, _read_tokenizer(root / "tokenizer.json"), eos, str(root))


def mtp_prefixes(config: dict, cfg: TargetConfig) -> tuple[str, ...]:
    """Tensor-name prefixes of MTP heads the config declares; the `mtp` node loads them, the target skips them."""
    prefixes = []
    for i in range(ConfigFields(config, cfg.source).int("num_nextn_predict_layers", 0, minimum=0)):  # DeepSeek-V3: extra layer indices
        prefixes.append(f"model.layers.{cfg.num_layers + i}.")
    if config.get("mtp_num_hidden_layers"):  # Qwen3-Next
        prefixes += ["mtp.", "model.mtp."]  # names are canonicalised with a `model.` prefix
    return tuple(prefixes)


def check_tensors(
    found: dict[str, tuple[int, ...]],
    cfg: TargetConfig,
    source: str,
    file_of: dict[str, str] | None = None,
    names: dict[str, str] | None = None,
) -> None:
    """Compare checkpoint tensor shapes (keyed by HF name) with `expected_tensors(cfg)`.

    Raises one ModelFormatError listing every missing, extra and mis-shaped tensor.
    `file_of` names the shard of each tensor; `names` maps HF names to the checkpoint's
    own spelling (GGUF) for the message.
    """
    file_of, names = file_of or {}, names or {}
    expected = expected_tensors(cfg)
    optional = {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)} if cfg.tie_word_embeddings else {}
    problems = []
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"tensor {names.get(name, name)!r} is missing (expected shape {list(shape)})")
    for name, shape in found.items():
        want = expected.get(name, optional.get(name))
        where = f"{file_of[name]}: " if name in file_of else ""
        shown = names.get(name, name)
        if want is None:
            problems.append(f"{where}tensor {shown!r} is not part of a {cfg.arch} model (extra tensor)")
        elif tuple(shape) != tuple(want):
            problems.append(f"{where}tensor {shown!r} has shape {list(shape)}, expected {list(want)}")
    if problems:
        more = f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise ModelFormatError(
            f"{source}: {len(problems)} weight problem(s) against {cfg.source or 'the config'}: "
            + "; ".join(problems[:_MAX_LISTED])
            + more
            + "; fix: make the config match the weights or re-export the checkpoint"
        )


def _shard_map(root: Path) -> dict[str, Path]:
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index, required=True).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ModelFormatError(
                f"{index}: field 'weight_map' is {weight_map!r:.80}; expected a tensor->file mapping; re-save the checkpoint"
            )
        return {_canonical(name): root / file for name, file in weight_map.items()}
    single = root / "model.safetensors"
    if not single.exists() and not single.is_symlink():
        raise ModelFormatError(
            f"{root}: neither model.safetensors nor model.safetensors.index.json exists; expected a "
            "safetensors checkpoint; save it with save_pretrained(..., safe_serialization=True)"
        )
    with _open(single, "cpu") as handle:
        return {_canonical(name): single for name in handle.keys()}


def _open(file: Path, device: torch.device | str) -> Any:
    if not file.exists() and not file.is_symlink():
        raise ModelFormatError(
            f"{file}: shard file is missing; expected it next to model.safetensors.index.json; re-download it"
        )
    return open_safetensors(file, str(device))


def _read_json(file: Path, required: bool) -> dict[str, Any]:
    """A JSON object file; absent and not required: {}. Unreadable, not JSON or not an object: ModelFormatError."""
    if not file.exists() and not file.is_symlink():
        if required:
            raise ModelFormatError(f"{file}: file is missing; expected a JSON file; point at an HF model directory")
        return {}
    return read_json_object(file)


def _read_tokenizer(file: Path) -> Tokenizer | None:
    if not file.exists() and not file.is_symlink():  # a broken link is an error below, not "no tokenizer"
        return None
    problem = file_problem(file)
    if problem:
        raise ModelFormatError(f"{file}: cannot be read: {problem}; expected a tokenizers JSON file; "
                               "check the path and its permissions")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise ModelFormatError(
            f"{file}: tokenizer cannot be parsed ({exc}); expected a tokenizers JSON file; re-download it"
        ) from exc


def _canonical(name: str) -> str:
    """Checkpoints saved from the inner model lack the `model.` prefix; add it back."""
    return name if name.startswith("model.") or name.startswith("lm_head.") else "model." + name


def _module_name(hf_name: str) -> str:
    return hf_name.removeprefix("model.")


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _Progress:
    """A one-line stderr progress bar, shown only for big loads on a terminal."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = total, label, 0
        self.enabled = total > _PROGRESS_MIN_BYTES and sys.stderr.isatty()

    def update(self, n: int) -> None:
        self.done += n
        if self.enabled:
            frac = self.done / self.total
            bar = "#" * int(30 * frac)
            sys.stderr.write(
                f"\r{self.label} [{bar:<30}] {100 * frac:5.1f}% "
                f"({self.done / 2**30:.2f}/{self.total / 2**30:.2f} GiB)"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
