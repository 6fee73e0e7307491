"""Read DFlash2 artifacts: Hugging Face directories and GGUF files (llama.cpp's `dflash` arch).

The backbone's config, GGUF keys and tensor names are DFlash's (this module reuses the
dflash loader, `loader.py`, for them); DFlash2 adds `conv_kernel_size`, `conv_group_size`,
`selector_rank`, `selector_top_k` and the tensors in `config.expected_tensors`.
Codebooks may be stored with or without `.weight` (published checkpoints have none);
both spellings of one tensor in one artifact are an error. A GGUF is DFlash2 when it
holds `selector_hidden.weight` (or its HF name).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import attrs
import torch
from gguf import GGMLQuantizationType, GGUFReader

from draftflow.plugin import ModelFormatError, open_safetensors
from draftflow.plugins.dflash import loader as dflash_loader
from draftflow.plugins.dflash.dflash2_config import CODEBOOKS, EXTRA_KEYS, DFlash2Config, expected_tensors
from draftflow.plugins.dflash.dflash2_model import DFlash2Model
from draftflow.plugins.dflash.loader import (
    GGUF_ARCH,
    Artifact,
    check_tensors,
    gguf_config,
    gguf_tensor,
    gguf_value,
    is_gguf,
    open_gguf,
    read_config_json,
)

# llama.cpp names of the DFlash2 tensors <-> HF names (codebooks with `.weight`).
GGUF_SELECTOR = {"selector_predecessor.weight": "candidate_selector.predecessor_codebook.weight",
                 "selector_successor.weight": "candidate_selector.successor_codebook.weight",
                 "selector_hidden.weight": "candidate_selector.hidden_projection.weight"}
GGUF_CONV = {"attn_conv": "attention_conv", "ffn_conv": "mlp_conv"}
_MARKERS = ("selector_hidden.weight", "candidate_selector.hidden_projection.weight")


def hf_to_gguf_name(name: str) -> str:
    """HF name -> llama.cpp name for backbone and DFlash2 tensors (codebooks with or without `.weight`)."""
    name = canonical_name(name)
    top = {v: k for k, v in GGUF_SELECTOR.items()}
    if name in top:
        return top[name]
    m = re.match(r"^layers\.(\d+)\.(attention_conv|mlp_conv)\.(base_kernel|kernel_projection\.weight)$", name)
    if m:
        conv = {v: k for k, v in GGUF_CONV.items()}[m[2]]
        return f"blk.{m[1]}.{conv}_base" if m[3] == "base_kernel" else f"blk.{m[1]}.{conv}_proj.weight"
    return dflash_loader.hf_to_gguf_name(name)


def gguf_to_hf_name(name: str) -> str:
    """Inverse of `hf_to_gguf_name`; unknown names (raw HF names too) pass through, codebooks gain `.weight`."""
    if name in GGUF_SELECTOR:
        return GGUF_SELECTOR[name]
    m = re.match(r"^blk\.(\d+)\.(attn_conv|ffn_conv)_(base|proj\.weight)$", name)
    if m:
        part = "base_kernel" if m[3] == "base" else "kernel_projection.weight"
        return f"layers.{m[1]}.{GGUF_CONV[m[2]]}.{part}"
    return canonical_name(dflash_loader.gguf_to_hf_name(name))


def canonical_name(name: str) -> str:
    """`candidate_selector.*_codebook` -> `...codebook.weight` (the checkpoint spelling has no suffix)."""
    return f"{name}.weight" if name in CODEBOOKS else name


def is_dflash2(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a DFlash2 artifact (HF `architectures`, or the selector tensor in a GGUF)."""
    p = Path(path)
    if not p.exists():
        return False
    if is_gguf(p):
        return any(t.name in _MARKERS for t in open_gguf(p).tensors)
    file = p / "config.json"
    return file.exists() and "DFlash2DraftModel" in (read_config_json(file).get("architectures") or [])


def read_config(path: str | os.PathLike[str]) -> DFlash2Config:
    """The config alone (no tensor data), for manifests and checks."""
    p = _existing(path)
    if is_gguf(p):
        return gguf_config2(open_gguf(p), str(p))
    return DFlash2Config.from_hf_dict(read_config_json(p / "config.json"), str(p / "config.json"))


def read_artifact(path: str | os.PathLike[str]) -> Artifact:
    """Config and every tensor (HF names, codebooks with `.weight`, stored dtype, CPU), validated."""
    p = _existing(path)
    return _read_gguf(p) if is_gguf(p) else _read_hf(p)


def load_drafter(path: str | os.PathLike[str], device, dtype: torch.dtype) -> tuple[DFlash2Model, DFlash2Config]:
    """Read, validate and place the drafter's weights on `device` in `dtype`."""
    art = read_artifact(path)
    return dflash_loader.instantiate(art, DFlash2Model, device, dtype), art.config


def gguf_config2(reader: GGUFReader, source: str) -> DFlash2Config:
    """DFlash2Config from `dflash.*` metadata; vocab_size falls back to the codebook's row count."""
    names = {t.name: t for t in reader.tensors}
    if not any(m in names for m in _MARKERS):
        raise ModelFormatError(f"{source}: no selector_hidden.weight tensor; this is a DFlash (v1) GGUF, "
                               "which runs with plugin: dflash")
    base = gguf_config(reader, source)
    if base.vocab_size is None:
        book = names.get("selector_predecessor.weight") or names.get("candidate_selector.predecessor_codebook.weight") \
            or names.get("candidate_selector.predecessor_codebook")
        if book is not None:
            base = attrs.evolve(base, vocab_size=int(book.shape[-1]))
    values = {}
    for key in EXTRA_KEYS:
        value = gguf_value(reader, f"{GGUF_ARCH}.{key}")
        if value is None:
            raise ModelFormatError(f"{source}: metadata key 'dflash.{key}' is missing; expected it in a DFlash2 GGUF; "
                                   "re-convert the artifact")
        values[key] = int(value)
    return DFlash2Config(base, **values)


def check_tensors2(found: dict[str, tuple[tuple[int, ...], str]], cfg: DFlash2Config, source: str,
                   names: dict[str, str] | None = None) -> None:
    """The dflash checks (DSpark, embedding/head, dtype, one message for missing/extra/mis-shaped) on the DFlash2 set."""
    check_tensors(found, cfg.base, source, names, expected=expected_tensors(cfg), kind="DFlash2")


def _existing(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.exists():
        raise ModelFormatError(f"{path}: no such DFlash2 directory or file; pass a DFlash2 HF directory or a .gguf file")
    return p


def _add(found: dict, names: dict, hf: str, stored: str, meta, source: str) -> None:
    if hf in found:
        raise ModelFormatError(f"{source}: tensors {names[hf]!r} and {stored!r} both name {hf!r}; "
                               "keep one spelling per tensor")
    found[hf], names[hf] = meta, stored


def _read_hf(root: Path) -> Artifact:
    cfg = DFlash2Config.from_hf_dict(read_config_json(root / "config.json"), str(root / "config.json"))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{root}: no *.safetensors file; expected the drafter weights next to config.json; "
                               "download the complete artifact")
    found, names, where = {}, {}, {}
    for file in files:
        handle = open_safetensors(file)
        for name in handle.keys():
            sl = handle.get_slice(name)
            _add(found, names, canonical_name(name), name, (tuple(sl.get_shape()), sl.get_dtype()), str(root))
            where[canonical_name(name)] = (handle, name)
    check_tensors2(found, cfg, str(root), names)
    tensors = {hf: handle.get_tensor(name) for hf, (handle, name) in where.items()}
    return Artifact(cfg, tensors, str(root), tensors["fc.weight"].dtype)


def _read_gguf(path: Path) -> Artifact:
    source = str(path)
    reader = open_gguf(path)
    cfg = gguf_config2(reader, source)
    found, names, by_hf = {}, {}, {}
    for t in reader.tensors:
        hf = gguf_to_hf_name(t.name)
        meta = (tuple(int(d) for d in reversed(t.shape)), GGMLQuantizationType(t.tensor_type).name)
        _add(found, names, hf, t.name, meta, source)
        by_hf[hf] = t
    check_tensors2(found, cfg, source, names)
    tensors = {hf: gguf_tensor(by_hf[hf], found[hf][0], source) for hf in found}
    file_type = gguf_value(reader, "general.file_type")
    file_dtype = {1: torch.float16, 32: torch.bfloat16}.get(file_type, tensors["fc.weight"].dtype)
    return Artifact(cfg, tensors, source, file_dtype)


__all__ = ["canonical_name", "check_tensors2", "gguf_to_hf_name", "hf_to_gguf_name", "is_dflash2", "load_drafter",
           "read_artifact", "read_config"]
