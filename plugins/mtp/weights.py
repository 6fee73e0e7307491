"""Finding, checking and reading MTP weights in a checkpoint, in either published layout.

- ``deepseek-v3``: one extra layer index after the target's layers,
  ``model.layers.{N}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head}`` plus a
  decoder block under the same prefix (an ``embed_tokens`` copy there is ignored: the
  target's embedding is shared). RMSNorm is x̂·w.
- ``qwen3-next``: ``mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm}`` and the
  block under ``mtp.layers.0.``; embedding and LM head are the target's. RMSNorm is x̂·(1+w).

The block is one full-attention decoder layer of the target's kind (``block_config``): a
Qwen3-Next target gives gated attention with partial RoPE; its MLP is a sparse MoE block
(routed experts ``mlp.experts.{j}.*`` + shared expert) when the checkpoint holds
``mlp.gate.weight`` under the block prefix and the config has experts, else a dense MLP.

Only headers are read to build a manifest; tensors are read when the node is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch
from safetensors import safe_open

from draftflow.layers.config import TargetConfig, expected_tensors, read_config
from draftflow.plugin import ModelFormatError, file_problem

LAYOUTS = ("deepseek-v3", "qwen3-next")
# Our module name -> checkpoint suffix, per layout (the block is added from the config).
HEAD_NAMES = {
    "deepseek-v3": {"norm_e.weight": "enorm.weight", "norm_h.weight": "hnorm.weight", "proj.weight": "eh_proj.weight",
                    "out_norm.weight": "shared_head.norm.weight", "head.weight": "shared_head.head.weight"},
    "qwen3-next": {"norm_e.weight": "pre_fc_norm_embedding.weight", "norm_h.weight": "pre_fc_norm_hidden.weight",
                   "proj.weight": "fc.weight", "out_norm.weight": "norm.weight"},
}
_IGNORED = ("embed_tokens.weight",)


@attrs.frozen
class MtpCheckpoint:
    """Where an MTP head's tensors are: config, layout, and checkpoint name -> (file, shape)."""

    config: TargetConfig
    layout: str
    prefix: str  # "model.layers.{N}." or "mtp."
    block_prefix: str  # prefix of the decoder block's tensors
    tensors: dict  # our module name -> (checkpoint name, file, shape)
    block_config: TargetConfig | None = None  # the one-layer config of the block (block_config)

    def nbytes(self, dtype: torch.dtype) -> int:
        return sum(_numel(shape) for _, _, shape in self.tensors.values()) * dtype.itemsize


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise ModelFormatError(f"{index}: no readable 'weight_map' ({exc}); re-save the checkpoint") from exc
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ModelFormatError(f"{index}: 'weight_map' is not a tensor -> file mapping; re-save the checkpoint")
        return sorted({path / f for f in weight_map.values()})
    return sorted(path.glob("*.safetensors"))


def _headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    found = {}
    for file in files:
        problem = file_problem(file)
        if problem:
            raise ModelFormatError(f"{file}: cannot be read: {problem}; expected a safetensors file; "
                                   "check the path and its permissions")
        try:
            with safe_open(str(file), framework="pt") as h:
                for name in h.keys():
                    found[name] = (file, tuple(h.get_slice(name).get_shape()))
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types for bad headers
            raise ModelFormatError(f"{file}: not a readable safetensors file ({exc}); re-download or re-save it") from exc
    return found


def _config_path(path: Path, config: str) -> Path:
    if config:
        c = Path(config)
        if not c.exists() or (c.is_file() and c.name != "config.json"):
            raise ModelFormatError(f"{config}: no such config directory or config.json; point params.config at the "
                                   "model's config.json or the directory holding it")
        return c.parent if c.name == "config.json" else c
    return path.parent if path.is_file() else path


def block_config(cfg: TargetConfig, layout: str, moe: bool = False) -> TargetConfig:
    """The MTP block as a one-layer target: full attention (never Gated DeltaNet), MoE or dense MLP.

    Qwen3-Next norms are x̂·(1+w) whatever the target's arch, so that layout sets ``norm_offset``.
    """
    return attrs.evolve(cfg, num_layers=1, tie_word_embeddings=True,
                        layer_types=("full_attention",) if cfg.layer_types else (),
                        moe_layers=(0,) if moe else (),
                        norm_offset=cfg.norm_offset or layout == "qwen3-next")


def _block_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    one = expected_tensors(cfg)
    return {n.removeprefix("model.layers.0."): s for n, s in one.items() if n.startswith("model.layers.0.")}


def find_mtp(path: str, config: str = "", layout: str = "auto") -> MtpCheckpoint:
    """Read config and safetensors headers under ``path``; raise one clear error if the MTP head is absent or misshapen."""
    root = Path(path)
    if not root.exists():
        raise ModelFormatError(f"{path}: no such file or directory; point params.path at a checkpoint with MTP weights")
    cfg = read_config(_config_path(root, config))
    headers = _headers(_files(root))
    n = cfg.num_layers
    prefixes = {"deepseek-v3": f"model.layers.{n}.", "qwen3-next": "mtp."}
    present = [lay for lay, pre in prefixes.items() if any(k.startswith(pre) for k in headers)]
    if layout == "auto":
        if not present:
            raise ModelFormatError(
                f"{path}: no MTP weights found; expected tensors 'model.layers.{n}.eh_proj.weight' (DeepSeek-V3 layout) "
                "or 'mtp.fc.weight' (Qwen3-Next layout); point params.path at a checkpoint or standalone "
                "safetensors file that has them")
        if len(present) > 1:
            raise ModelFormatError(f"{path}: holds both DeepSeek-V3 and Qwen3-Next MTP tensors; set params.layout")
        layout = present[0]
    prefix = prefixes[layout]
    block_prefix = prefix + ("layers.0." if layout == "qwen3-next" else "")
    # A router weight under the block marks a sparse MoE block; a config without experts cannot describe one.
    moe = cfg.num_experts > 0 and block_prefix + "mlp.gate.weight" in headers
    block_cfg = block_config(cfg, layout, moe)
    block = _block_shapes(block_cfg)
    h = cfg.hidden_size
    want = {"norm_e.weight": (h,), "norm_h.weight": (h,), "proj.weight": (h, 2 * h), "out_norm.weight": (h,),
            "head.weight": (cfg.vocab_size, h)}
    names = {ours: prefix + theirs for ours, theirs in HEAD_NAMES[layout].items()}
    names.update({"block." + rel: block_prefix + rel for rel in block})
    want.update({"block." + rel: s for rel, s in block.items()})
    problems, tensors = [], {}
    for ours, theirs in names.items():
        if theirs not in headers:
            problems.append(f"tensor {theirs!r} is missing (expected shape {list(want[ours])})")
        elif headers[theirs][1] != want[ours]:
            problems.append(f"tensor {theirs!r} has shape {list(headers[theirs][1])}, expected {list(want[ours])}")
        else:
            tensors[ours] = (theirs, headers[theirs][0], want[ours])
    known = set(names.values()) | {prefix + i for i in _IGNORED}
    extra = sorted(k for k in headers if k.startswith(prefix) and k not in known)
    kind = "sparse-MoE" if moe else "dense-MLP"
    problems += [f"tensor {k!r} is not part of a {kind} MTP head for this config (extra tensor)" for k in extra[:3]]
    if problems:
        raise ModelFormatError(f"{path}: {len(problems)} MTP weight problem(s) for the {layout} layout: "
                               + "; ".join(problems[:5]) + "; fix: re-export the MTP head for this config")
    return MtpCheckpoint(cfg, layout, prefix, block_prefix, tensors, block_cfg)


def read_state(ckpt: MtpCheckpoint, device: torch.device, dtype: torch.dtype,
               host_prefix: str | None = None) -> dict[str, torch.Tensor]:
    """Our module name -> tensor on ``device`` in ``dtype`` (names starting with ``host_prefix``: on the CPU)."""
    state, handles = {}, {}
    for ours, (theirs, file, _) in ckpt.tensors.items():
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        where = "cpu" if host_prefix and ours.startswith(host_prefix) else device
        state[ours] = handles[file].get_tensor(theirs).to(device=where, dtype=dtype)
    return state


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
