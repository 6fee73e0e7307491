"""Read DFlash artifacts: z-lab Hugging Face directories and GGUF files.

Both paths end in the same place: a `DFlashConfig` plus HF-named tensors, checked by
`check_tensors` before any weight is used. GGUF files may use llama.cpp's `dflash`
architecture names (`blk.N.*`, `enc.output_norm`, `output_norm`, `dflash.target_layers`
= ids + 1) or raw Hugging Face tensor names. Artifacts of neighbouring formats (DFlash2,
DSpark) and artifacts that carry their own embedding or LM head are rejected with a
message that says what they are.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from draftflow.layers.gguf_names import LAYER_NAMES
from draftflow.plugin import ModelFormatError, open_safetensors, read_json_object
from draftflow.plugins.dflash.config import DFlashConfig, expected_tensors
from draftflow.plugins.dflash.model import DFlashModel

GGUF_ARCH = "dflash"
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# llama.cpp top-level names <-> HF names.
GGUF_TOP = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight", "output_norm.weight": "norm.weight"}
_GGUF_LAYER = {v: k for k, v in LAYER_NAMES.items()}
_DFLASH2 = re.compile(r"attention_conv|mlp_conv|candidate_selector|attn_conv_|ffn_conv_|(^|\.)selector_")
_DSPARK = re.compile(r"markov|conf_proj|(^|\.)d2t($|\.)")
_EMBED_OR_HEAD = re.compile(r"embed_tokens|lm_head|^token_embd\.|^output\.")
_MAX_LISTED = 5


@attrs.frozen
class Artifact:
    """A read artifact: config, HF-named tensors in their stored dtype, and where it came from."""

    config: DFlashConfig
    tensors: dict[str, torch.Tensor]
    source: str
    file_dtype: torch.dtype  # the dtype 1-D tensors had before a GGUF stored them as F32


def is_gguf(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return p.suffix == ".gguf" or (p.is_file() and p.read_bytes()[:4] == b"GGUF")


def hf_to_gguf_name(name: str) -> str:
    """`layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`; top-level names as llama.cpp."""
    top = {v: k for k, v in GGUF_TOP.items()}
    if name in top:
        return top[name]
    _, layer, rest = name.split(".", 2)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def gguf_to_hf_name(name: str) -> str:
    """Inverse of `hf_to_gguf_name`; names it does not know (raw HF names too) pass through."""
    if name in GGUF_TOP:
        return GGUF_TOP[name]
    m = re.match(r"^blk\.(\d+)\.(\w+)\.(\w+)$", name)
    if m and m[2] in _GGUF_LAYER:
        return f"layers.{m[1]}.{_GGUF_LAYER[m[2]]}.{m[3]}"
    return name


def read_config(path: str | os.PathLike[str]) -> DFlashConfig:
    """The config alone (no tensor data), for manifests."""
    p = Path(path)
    if not p.exists():
        raise ModelFormatError(f"{path}: no such DFlash directory or file; pass a z-lab HF directory or a .gguf file")
    if is_gguf(p):
        return gguf_config(open_gguf(p), str(p))
    return DFlashConfig.from_hf_dict(read_config_json(p / "config.json"), str(p / "config.json"))


def read_artifact(path: str | os.PathLike[str]) -> Artifact:
    """Config and every tensor (stored dtype, CPU), validated against each other."""
    p = Path(path)
    if not p.exists():
        raise ModelFormatError(f"{path}: no such DFlash directory or file; pass a z-lab HF directory or a .gguf file")
    return _read_gguf(p) if is_gguf(p) else _read_hf(p)


def instantiate(art, model_cls, device, dtype: torch.dtype):
    """Build `model_cls(art.config)` on the meta device and place the artifact's weights on `device`."""
    model = model_cls(art.config, dtype=dtype, device="meta")
    state = {name: t.to(device=device, dtype=dtype) for name, t in art.tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)  # the non-persistent RoPE buffer
    return model


def load_drafter(path: str | os.PathLike[str], device, dtype: torch.dtype) -> tuple[DFlashModel, DFlashConfig]:
    """Read, validate and place the drafter's weights on `device` in `dtype`."""
    art = read_artifact(path)
    return instantiate(art, DFlashModel, device, dtype), art.config


def check_tensors(found: dict[str, tuple[tuple[int, ...], str]], cfg: DFlashConfig, source: str,
                  names: dict[str, str] | None = None, expected: dict[str, tuple[int, ...]] | None = None,
                  kind: str = "DFlash") -> None:
    """Validate tensor names, shapes and dtypes (keyed by HF name) against `cfg`.

    Foreign formats are rejected first, each with its own message; then one message lists
    every missing, extra and mis-shaped tensor. The dflash2 plugin passes its own
    `expected` set (which includes the DFlash2 tensors) and `kind="DFlash2"`.
    """
    names = names or {}
    shown = {hf: names.get(hf, hf) for hf in found}
    for hf, name in shown.items():
        if expected is None and (_DFLASH2.search(hf) or _DFLASH2.search(name)):
            raise ModelFormatError(
                f"{source}: tensor {name!r} is a DFlash2 convolution/selector tensor; this is a DFlash2 artifact, "
                "which the dflash node cannot run; use the dflash2 plugin (plugin: dflash2) for it")
    for hf, name in shown.items():
        if _DSPARK.search(hf) or _DSPARK.search(name):
            raise ModelFormatError(
                f"{source}: tensor {name!r} is a DSpark Markov/confidence tensor; DSpark drafters are not supported; "
                "use a plain DFlash artifact")
    for hf, name in shown.items():
        if _EMBED_OR_HEAD.search(hf) or _EMBED_OR_HEAD.search(name):
            raise ModelFormatError(
                f"{source}: tensor {name!r} is an embedding or LM head inside the artifact; DFlash binds both from "
                "the target model; remove it from the artifact")
    for hf, (_, dtype) in found.items():
        if dtype not in DTYPES:
            raise ModelFormatError(f"{source}: tensor {shown[hf]!r} has dtype {dtype}; expected BF16, F16 or F32; "
                                   "re-export the artifact in one of them")
    expected = expected_tensors(cfg) if expected is None else expected
    problems = [f"tensor {names.get(n, n)!r} is missing (expected shape {list(s)})" for n, s in expected.items() if n not in found]
    for hf, (shape, _) in found.items():
        want = expected.get(hf)
        if want is None:
            problems.append(f"tensor {shown[hf]!r} is not part of a {kind} drafter (unknown extra tensor)")
        elif tuple(shape) != want:
            problems.append(f"tensor {shown[hf]!r} has shape {list(shape)}, expected {list(want)}")
    if problems:
        more = f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise ModelFormatError(
            f"{source}: {len(problems)} tensor problem(s) against a {cfg.num_layers}-layer, {cfg.num_taps}-tap {kind} "
            f"config ({len(expected)} tensors expected): " + "; ".join(problems[:_MAX_LISTED]) + more
            + "; fix: make the config match the weights or re-export the artifact")


# --- Hugging Face --------------------------------------------------------------------------
def _read_hf(root: Path) -> Artifact:
    cfg = DFlashConfig.from_hf_dict(read_config_json(root / "config.json"), str(root / "config.json"))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{root}: no *.safetensors file; expected the drafter weights next to config.json; "
                               "download the complete artifact")
    handles, found, file_of = {}, {}, {}
    for file in files:
        handles[file] = h = open_safetensors(file)
        for name in h.keys():
            sl = h.get_slice(name)
            found[name] = (tuple(sl.get_shape()), sl.get_dtype())
            file_of[name] = file
    check_tensors(found, cfg, str(root))
    tensors = {name: handles[file_of[name]].get_tensor(name) for name in found}
    return Artifact(cfg, tensors, str(root), tensors["fc.weight"].dtype)


def read_config_json(file: Path) -> dict[str, Any]:
    """A drafter directory's config.json as a dict (one clear error when missing or not a JSON object)."""
    if not file.exists() and not file.is_symlink():
        raise ModelFormatError(f"{file}: file is missing; expected a z-lab DFlash config.json; point at the drafter directory")
    return read_json_object(file, "a z-lab DFlash config.json object")


# --- GGUF ------------------------------------------------------------------------------------
def open_gguf(path: Path) -> GGUFReader:
    """A GGUF reader on `path` (one clear error on unreadable bytes)."""
    try:
        return GGUFReader(path, "c")
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError, IndexError, ... on bad bytes
        raise ModelFormatError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc}); re-convert it") from exc


def gguf_value(reader: GGUFReader, key: str) -> Any:
    """A metadata value, or None when the key is absent."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _f32(value: Any) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-06, not 9.99e-07)."""
    return float(str(np.float32(value)))


def gguf_config(reader: GGUFReader, source: str) -> DFlashConfig:
    """DFlashConfig from `dflash.*` metadata (llama.cpp keys; target_layers stored as ids + 1)."""
    arch = gguf_value(reader, "general.architecture")
    if arch != GGUF_ARCH:
        raise ModelFormatError(f"{source}: general.architecture is {arch!r}; expected 'dflash'; "
                               "this file is not a DFlash drafter")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = gguf_value(reader, f"{GGUF_ARCH}.{key}")
        if value is None and required:
            raise ModelFormatError(f"{source}: metadata key 'dflash.{key}' is missing; expected it; re-convert the artifact")
        return default if value is None else value

    hidden, heads = int(get("embedding_length", required=True)), int(get("attention.head_count", required=True))
    stored = get("target_layers")
    n_target = get("num_target_layers")
    mask = gguf_value(reader, "tokenizer.ggml.mask_token_id")
    mask = get("mask_token_id") if mask is None else mask
    pattern = get("attention.sliding_window_pattern")
    window = get("attention.sliding_window")
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelFormatError(f"{source}: 'dflash.rope.scaling.type' is {scaling!r}; expected none; "
                               "RoPE scaling in DFlash GGUF files is not supported")
    d: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", required=True)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 40960)),
        "block_size": int(get("block_size", 16)),
        "dflash_config": {"mask_token_id": None if mask is None else int(mask)},
    }
    if stored is not None:
        d["dflash_config"]["target_layer_ids"] = [int(i) - 1 for i in stored]
    if n_target is not None:
        d["num_target_layers"] = int(n_target)
    if get("vocab_size") is not None:
        d["vocab_size"] = int(get("vocab_size"))
    if pattern is not None:
        d["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
        d["sliding_window"] = None if window is None else int(window)
    if get("attention.causal") is not None:
        d["is_causal"] = bool(get("attention.causal"))
    for key, hf in (("embedding_scale", "input_embedding_scale"), ("logit_scale", "output_multiplier"),
                    ("final_logit_softcapping", "final_logit_softcapping")):
        if get(key) is not None:
            d["dflash_config"][hf] = _f32(get(key))
    return DFlashConfig.from_hf_dict(d, source)


def _read_gguf(path: Path) -> Artifact:
    source = str(path)
    reader = open_gguf(path)
    cfg = gguf_config(reader, source)
    found, names, by_hf = {}, {}, {}
    for t in reader.tensors:
        hf = gguf_to_hf_name(t.name)
        if hf in found:
            raise ModelFormatError(f"{source}: tensors {names[hf]!r} and {t.name!r} both name {hf!r}; "
                                   "keep one spelling (llama.cpp or Hugging Face) per tensor")
        found[hf] = (tuple(int(d) for d in reversed(t.shape)), GGMLQuantizationType(t.tensor_type).name)
        names[hf], by_hf[hf] = t.name, t
    check_tensors(found, cfg, source, names)
    tensors = {hf: gguf_tensor(by_hf[hf], found[hf][0], source) for hf in found}
    file_type = gguf_value(reader, "general.file_type")
    file_dtype = {1: torch.float16, 32: torch.bfloat16}.get(file_type, tensors["fc.weight"].dtype)
    return Artifact(cfg, tensors, source, file_dtype)


def gguf_tensor(t: Any, shape: tuple[int, ...], source: str) -> torch.Tensor:
    """A GGUF tensor's data as a CPU tensor of `shape` (HF order; BF16 bytes viewed as bfloat16)."""
    try:
        raw = torch.from_numpy(np.ascontiguousarray(t.data))
    except Exception as exc:  # noqa: BLE001 - a short file gives a short view
        raise ModelFormatError(f"{source}: tensor {t.name!r} data cannot be read ({exc}); re-convert it") from exc
    if GGMLQuantizationType(t.tensor_type) == GGMLQuantizationType.BF16:  # bytes -> bf16
        raw = raw.view(torch.bfloat16)
    return raw.reshape(shape)
