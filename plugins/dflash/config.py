"""DFlash drafter configuration: the facts the model, loader, converter and manifest share.

`DFlashConfig` is built from a z-lab `config.json` (a Qwen3 config plus `block_size`,
`num_target_layers` and `dflash_config`) or from GGUF metadata by the loader.
`expected_tensors` is the single source of truth for the artifact's tensor set:
11 per draft layer + `fc`, `hidden_norm`, `norm` (58 for 5 layers).
"""

from __future__ import annotations

import math

from typing import Any

import attrs
import torch

from draftflow.layers.config import ConfigFields, RopeScaling, rope_scaling_of
from draftflow.plugin import ModelFormatError

LAYER_TYPES = ("full_attention", "sliding_attention")
# HF module suffix inside `layers.N.` -> shape as a function of the config (see expected_tensors).
LAYER_TENSORS = (
    "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj",
)
TOP_TENSORS = ("fc.weight", "hidden_norm.weight", "norm.weight")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's rule when `target_layer_ids` is absent: spread taps over layers 1 .. n_tgt-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    # Python's round() (half to even) is part of the rule: [1, 9, 17, 25, 33] for 36 / 5.
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@attrs.frozen
class DFlashConfig:
    """Shapes and numerics of a DFlash block drafter (Qwen3-style draft layers)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int | None = None
    vocab_size: int | None = None  # informational: the target's table is used
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: causal only for sliding layers (dflash 0.1.0)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    source: str = attrs.field(default="", eq=False)

    def __attrs_post_init__(self) -> None:
        src = self.source or "dflash config"
        if self.num_heads % self.num_kv_heads:
            raise ModelFormatError(f"{src}: num_attention_heads={self.num_heads} is not a multiple of "
                                   f"num_key_value_heads={self.num_kv_heads}; fix the config")
        if self.block_size < 2:
            raise ModelFormatError(f"{src}: block_size={self.block_size}; expected at least 2 (anchor + one draft); fix the config")
        if not self.target_layer_ids:
            raise ModelFormatError(f"{src}: target_layer_ids is empty; expected at least one tap layer; fix the config")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelFormatError(f"{src}: layer_types has {len(self.layer_types)} entries for {self.num_layers} layers; fix the config")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ModelFormatError(f"{src}: layer_types entry {bad[0]!r} is not one of {', '.join(LAYER_TYPES)}; fix the config")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ModelFormatError(f"{src}: sliding_attention layers need a positive sliding_window; fix the config")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def rotary_dim(self) -> int:
        """RoPE covers the whole head (what `rope_inv_freq` reads)."""
        return self.head_dim

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def layer_span(self, i: int) -> int | None:
        """Layer i's sliding window in cells (a row sees keys less than this far behind it); None for a full layer."""
        return self.sliding_window if self.layer_type(i) == "sliding_attention" else None

    def layer_is_causal(self, i: int) -> bool:
        return self.layer_type(i) == "sliding_attention" if self.is_causal is None else self.is_causal

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str) -> DFlashConfig:
        """Build from a z-lab `config.json` dict; `source` names the file in messages."""
        if not isinstance(d, dict):
            raise ModelFormatError(f"{source}: holds a JSON {type(d).__name__}; expected an object of config fields; "
                                   "point at a z-lab DFlash directory")
        get = ConfigFields(d, source)
        extra = get.mapping("dflash_config")

        def field(key: str) -> ConfigFields:
            # z-lab's lookup order: dflash_config first, then the top level.
            return get.nested("dflash_config") if extra.get(key) is not None else get

        hidden, heads = get.int("hidden_size"), get.int("num_attention_heads")
        layers = get.int("num_hidden_layers")
        if d.get("hidden_act", "silu") != "silu":
            raise ModelFormatError(f"{source}: field 'hidden_act' is {d['hidden_act']!r}; expected 'silu'; "
                                   "only SiLU-gated draft MLPs are supported")
        if d.get("attention_bias"):
            raise ModelFormatError(f"{source}: field 'attention_bias' is true; expected false; DFlash artifacts "
                                   "carry no attention biases (11 tensors per layer)")
        rope_key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
        rope = get.mapping(rope_key)
        n_target = field("num_target_layers").int("num_target_layers", None)
        ids = extra.get("target_layer_ids", d.get("target_layer_ids"))
        if ids is None:
            if n_target is None or n_target < 4:
                raise ModelFormatError(f"{source}: target_layer_ids is absent and num_target_layers is {n_target!r}; "
                                       "expected one of them; set dflash_config.target_layer_ids")
            ids = default_target_layer_ids(n_target, layers)
        elif not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ModelFormatError(f"{source}: target_layer_ids is {ids!r}; expected a list of target layer indices; "
                                   "set dflash_config.target_layer_ids")
        mask = extra.get("mask_token_id", d.get("mask_token_id"))
        if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
            raise ModelFormatError(f"{source}: mask_token_id is {mask!r}; expected a token id; "
                                   "set dflash_config.mask_token_id")
        softcap = extra.get("final_logit_softcapping", d.get("final_logit_softcapping"))
        softcap = field("final_logit_softcapping").number("final_logit_softcapping") if softcap else None  # 0: none
        layer_types = d.get("layer_types")
        if layer_types is not None and not isinstance(layer_types, list):
            raise ModelFormatError(f"{source}: field 'layer_types' is {layer_types!r}; expected a list of layer types; fix the config")
        has_sliding = bool(layer_types) and "sliding_attention" in layer_types
        is_causal = d.get("is_causal")
        if is_causal is not None and not isinstance(is_causal, bool):
            raise ModelFormatError(f"{source}: field 'is_causal' is {is_causal!r}; expected true, false or null; fix the config")
        return cls(
            hidden_size=hidden,
            intermediate_size=get.int("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=get.int("num_key_value_heads", heads),
            head_dim=get.int("head_dim", hidden // heads),
            rms_norm_eps=get.number("rms_norm_eps", 1e-6),
            rope_theta=get.nested(rope_key).number("rope_theta") if "rope_theta" in rope else get.number("rope_theta", 10000.0),
            rope_scaling=rope_scaling_of(rope, get.nested(rope_key), d, source),
            max_position_embeddings=get.int("max_position_embeddings", 40960),
            block_size=field("block_size").int("block_size", 16),
            target_layer_ids=tuple(ids),
            mask_token_id=mask,
            num_target_layers=n_target,
            vocab_size=get.int("vocab_size", None),
            layer_types=tuple(layer_types or ()),
            sliding_window=get.int("sliding_window") if has_sliding and d.get("sliding_window") else None,
            is_causal=is_causal,
            input_embedding_scale=field("input_embedding_scale").number("input_embedding_scale", 1.0),
            output_multiplier=field("output_multiplier").number("output_multiplier", 1.0),
            final_logit_softcapping=softcap,
            source=source,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The z-lab `config.json` for this config (what the converter writes)."""
        d: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        }
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            d["rope_scaling"] = {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                                 "high_freq_factor": rs.high_freq_factor,
                                 "original_max_position_embeddings": rs.original_max_position_embeddings}
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.vocab_size is not None:
            d["vocab_size"] = self.vocab_size
        if self.layer_types:
            d["layer_types"] = list(self.layer_types)
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
            d["use_sliding_window"] = True  # transformers' Qwen3Config drops sliding_window without it
        if self.is_causal is not None:
            d["is_causal"] = self.is_causal
        extra = d["dflash_config"]
        if self.input_embedding_scale != 1.0:
            extra["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            extra["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            extra["final_logit_softcapping"] = self.final_logit_softcapping
        return d


def expected_tensors(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape ([out, in]) for every tensor a DFlash artifact must hold."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    shapes = {
        "input_layernorm": (h,), "post_attention_layernorm": (h,),
        "self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q), "self_attn.q_norm": (d,), "self_attn.k_norm": (d,),
        "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter),
    }
    out = {"fc.weight": (h, cfg.num_taps * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(cfg.num_layers):
        for module in LAYER_TENSORS:
            out[f"layers.{i}.{module}.weight"] = shapes[module]
    return out


def weight_bytes(cfg: DFlashConfig, dtype: torch.dtype) -> int:
    """Bytes the drafter's own weights take in `dtype` (embedding and head are the target's)."""
    return sum(math.prod(shape) for shape in expected_tensors(cfg).values()) * dtype.itemsize


def kv_shape(cfg: DFlashConfig, capacity, batch=1) -> tuple:
    """Shape of the drafter's context K/V buffer (the target KVCache layout; one row per request slot)."""
    return (cfg.num_layers, 2, batch, capacity, cfg.num_kv_heads, cfg.head_dim)


def drafter_dtype(params, graph_dtype: str) -> str:
    """The dtype a DFlash/DFlash2 node computes in: its `dtype` param, or the graph's."""
    chosen = params.get("dtype", "graph")
    return graph_dtype if chosen == "graph" else chosen


def node_dtype(params, graph_dtype: torch.dtype) -> torch.dtype:
    """`drafter_dtype` for a built node, whose context holds the graph's dtype as a torch.dtype."""
    chosen = params.get("dtype", "graph")
    return graph_dtype if chosen == "graph" else getattr(torch, chosen)


def head_copy_bytes(vocab: int, hidden: int, dtype: str, graph_dtype: str) -> int:
    """Bytes of the drafter's own copies of the target's embedding and LM head (none in the graph's dtype)."""
    return 0 if dtype == graph_dtype else 2 * vocab * hidden * getattr(torch, dtype).itemsize
