"""DFlash2 drafter configuration: the DFlash backbone's config plus convolution and selector sizes.

`DFlash2Config.base` is a plain `DFlashConfig` (the backbone runs DFlash's code), the
other fields are the DFlash2 extras from `dflash_config`. `expected_tensors` is the
artifact's tensor set: DFlash's 11 per layer + 3, plus 4 convolution tensors per layer
and 3 selector tensors (81 for 5 layers).
"""

from __future__ import annotations

import math

from typing import Any

import attrs
import torch

from draftflow.plugin import ModelFormatError
from draftflow.plugins.dflash.config import DFlashConfig
from draftflow.plugins.dflash.config import expected_tensors as backbone_tensors

ARCHITECTURE = "DFlash2DraftModel"
EXTRA_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
CONVS = ("attention_conv", "mlp_conv")
# HF checkpoints store the codebooks without `.weight` (they are embedding tables); loaders add it.
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


@attrs.frozen
class DFlash2Config:
    """A DFlash backbone plus grouped dynamic convolutions and a candidate selector."""

    base: DFlashConfig
    conv_kernel_size: int  # K: taps of the causal convolution over block rows
    conv_group_size: int  # G: channels sharing one dynamic coefficient
    selector_rank: int  # R: codebook width
    selector_top_k: int  # M: candidates per draft row

    def __attrs_post_init__(self) -> None:
        src, b = self.base.source or "dflash2 config", self.base
        if b.vocab_size is None:
            raise ModelFormatError(f"{src}: vocab_size is missing; DFlash2 codebooks have one row per token; "
                                   "set vocab_size (the target's vocabulary size)")
        if not 1 <= self.conv_kernel_size <= b.block_size:
            raise ModelFormatError(f"{src}: conv_kernel_size={self.conv_kernel_size}; expected 1..block_size "
                                   f"({b.block_size}); fix dflash_config.conv_kernel_size")
        if self.conv_group_size <= 0 or b.hidden_size % self.conv_group_size:
            raise ModelFormatError(f"{src}: conv_group_size={self.conv_group_size} does not divide hidden_size="
                                   f"{b.hidden_size}; fix dflash_config.conv_group_size")
        if self.selector_rank <= 0:
            raise ModelFormatError(f"{src}: selector_rank={self.selector_rank}; expected a positive integer; "
                                   "fix dflash_config.selector_rank")
        if not 1 <= self.selector_top_k <= b.vocab_size:
            raise ModelFormatError(f"{src}: selector_top_k={self.selector_top_k}; expected 1..vocab_size "
                                   f"({b.vocab_size}); fix dflash_config.selector_top_k")

    @property
    def vocab_size(self) -> int:
        return int(self.base.vocab_size)

    @property
    def num_groups(self) -> int:
        return self.base.hidden_size // self.conv_group_size

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str) -> DFlash2Config:
        """Build from a `config.json` whose `architectures` names DFlash2DraftModel."""
        if not isinstance(d, dict):
            raise ModelFormatError(f"{source}: holds a JSON {type(d).__name__}; expected an object of config fields; "
                                   "point at a DFlash2 directory")
        arch = d.get("architectures") or []
        if not isinstance(arch, list) or ARCHITECTURE not in arch:
            raise ModelFormatError(f"{source}: architectures is {arch!r}; expected ['{ARCHITECTURE}']; "
                                   "a DFlash (v1) drafter runs with plugin: dflash")
        extra = {} if d.get("dflash_config") is None else d["dflash_config"]
        if not isinstance(extra, dict):
            raise ModelFormatError(f"{source}: field 'dflash_config' is {extra!r}; expected an object; fix the config")
        values = {}
        for key in EXTRA_KEYS:
            value = extra.get(key, d.get(key))
            if not isinstance(value, int) or isinstance(value, bool):
                raise ModelFormatError(f"{source}: {key} is {value!r}; expected an integer; set dflash_config.{key}")
            values[key] = value
        return cls(DFlashConfig.from_hf_dict(d, source), **values)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` for this config (what the converter writes)."""
        d = self.base.to_hf_dict()
        d["architectures"] = [ARCHITECTURE]
        d["auto_map"] = {"AutoModel": f"dflash.{ARCHITECTURE}"}
        d["vocab_size"] = self.vocab_size
        d["dflash_config"].update({key: getattr(self, key) for key in EXTRA_KEYS})
        return d


def expected_tensors(cfg: DFlash2Config) -> dict[str, tuple[int, ...]]:
    """HF tensor name (codebooks with `.weight`) -> shape for every tensor a DFlash2 artifact holds."""
    h, k, r = cfg.base.hidden_size, cfg.conv_kernel_size, cfg.selector_rank
    out = backbone_tensors(cfg.base)
    for i in range(cfg.base.num_layers):
        for conv in CONVS:
            out[f"layers.{i}.{conv}.base_kernel"] = (2, k, h)
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * cfg.num_groups, h)
    for codebook in CODEBOOKS:
        out[f"{codebook}.weight"] = (cfg.vocab_size, r)
    out["candidate_selector.hidden_projection.weight"] = (r, h)
    return out


def weight_bytes(cfg: DFlash2Config, dtype: torch.dtype) -> int:
    """Bytes of the drafter's own weights in `dtype` (the embedding and LM head are the target's)."""
    return sum(math.prod(shape) for shape in expected_tensors(cfg).values()) * dtype.itemsize
