"""Target-model configuration: the architecture facts every other module reads.

`TargetConfig` is built once from a Hugging Face `config.json` dict (or from GGUF
metadata by the GGUF loader) and never changes. `expected_tensors` is the single
source of truth for which weights a checkpoint must hold and with which shapes.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import attrs
import torch

from draftflow.core.errors import ModelFormatError
from draftflow.core.files import read_json_object

# HF `architectures[0]` and `model_type` spellings -> our arch name.
SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama", "qwen2": "qwen2", "qwen3_next": "qwen3_next", "qwen3_moe": "qwen3_moe"}
LAYER_TYPES = ("full_attention", "linear_attention")


@attrs.frozen
class RopeScaling:
    """How RoPE inverse frequencies are rescaled.

    `llama3` keeps the four HF parameters so the HF path reproduces transformers bit for
    bit; `freq_factors` holds per-frequency divisors as llama.cpp stores them
    (`rope_freqs.weight`), because a GGUF file does not carry the four parameters.
    """

    rope_type: str = attrs.field(validator=attrs.validators.in_(("llama3", "freq_factors")))
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None


@attrs.frozen
class TargetConfig:
    """Shapes and numerics of a decoder-only target model (qwen3, llama, qwen2, or qwen3_next hybrid)."""

    arch: str = attrs.field(validator=attrs.validators.in_(tuple(_MODEL_TYPES.values())))
    vocab_size: int
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
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    o_bias: bool  # bias on the output projection (llama/qwen3 `attention_bias`, never qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""
    # Hybrid (qwen3_next) fields; the defaults describe a plain dense decoder.
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "linear_attention"; () = all full
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims only
    attn_output_gate: bool = False  # q_proj also emits a per-channel gate; output *= sigmoid(gate)
    norm_offset: bool = False  # RMSNorm scales by (1 + w) instead of w
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    # MoE fields (qwen3_moe; moe.py); num_experts == 0 describes a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] = ()  # decoder layers whose MLP is a sparse MoE block
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a sparse MoE block instead of a dense MLP."""
        return layer in self.moe_layers

    def is_linear(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a Gated DeltaNet (linear-attention) layer."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def num_linear_layers(self) -> int:
        return sum(self.is_linear(i) for i in range(self.num_layers))

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache (full attention); linear layers keep a recurrent state instead."""
        return self.num_layers - self.num_linear_layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the short causal conv: q, k and v of every linear head."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelFormatError(
                f"{self.source}: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; expected a whole GQA ratio; fix the config"
            )
        if self.head_dim % 2 or self.rotary_dim % 2:
            raise ModelFormatError(
                f"{self.source}: head_dim={self.head_dim} (rotary part {self.rotary_dim}) is odd; expected an even "
                "RoPE dimension; fix the config"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelFormatError(
                f"{self.source}: field 'layer_types' has {len(self.layer_types)} entries; expected one per layer "
                f"(num_hidden_layers={self.num_layers}); fix the config"
            )
        if self.is_hybrid and self.linear_num_value_heads % max(self.linear_num_key_heads, 1):
            raise ModelFormatError(
                f"{self.source}: linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}; expected whole value groups; fix the config"
            )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str) -> TargetConfig:
        """Build from a parsed HF `config.json`; `source` names the file in error messages."""
        if not isinstance(d, dict):
            raise ModelFormatError(f"{source}: holds a JSON {type(d).__name__}; expected an object of config fields; "
                                   "point at a Hugging Face model directory")
        arch = _arch_of(d, source)
        get = ConfigFields(d, source)
        hidden, heads = get.int("hidden_size"), get.int("num_attention_heads")
        if d.get("hidden_act", "silu") != "silu":
            raise ModelFormatError(
                f"{source}: field 'hidden_act' is {d['hidden_act']!r}; expected 'silu'; "
                "only SiLU-gated MLPs are supported"
            )
        if d.get("mlp_bias"):
            raise ModelFormatError(
                f"{source}: field 'mlp_bias' is true; expected false; MLP biases are not supported"
            )
        if d.get("use_sliding_window"):
            raise ModelFormatError(
                f"{source}: field 'use_sliding_window' is true; expected false; "
                "sliding-window attention is not supported, set it to false only if the model was trained without it"
            )
        # transformers 5 writes `rope_parameters` (theta inside); 4.x writes `rope_theta` + `rope_scaling`.
        rope_key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
        rope = get.mapping(rope_key)
        theta = get.nested(rope_key).number("rope_theta") if "rope_theta" in rope else get.number("rope_theta", 10000.0)
        bias = get.bool("attention_bias", False)
        hybrid = _hybrid_fields(d, get, source) if arch == "qwen3_next" else {}
        if arch == "qwen3_moe":
            from draftflow.layers.moe import moe_fields

            hybrid.update(moe_fields(d, source, get.int("num_hidden_layers")))
        return cls(
            arch=arch,
            vocab_size=get.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get.int("intermediate_size"),
            num_layers=get.int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=get.int("num_key_value_heads", heads),
            head_dim=get.int("head_dim", hidden // heads),
            rms_norm_eps=get.number("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope_scaling_of(rope, get.nested(rope_key), d, source),
            max_position_embeddings=get.int("max_position_embeddings", 2048),
            tie_word_embeddings=get.bool("tie_word_embeddings", False),
            attention_bias=True if arch == "qwen2" else bias,
            o_bias=False if arch == "qwen2" else bias,
            qk_norm=arch in ("qwen3", "qwen3_next", "qwen3_moe"),
            bos_token_id=get.token_id("bos_token_id"),
            eos_token_ids=get.token_ids("eos_token_id"),
            source=source,
            **hybrid,
        )


def _hybrid_fields(d: dict[str, Any], get: ConfigFields, source: str) -> dict[str, Any]:
    """Qwen3-Next extras: the layer pattern, gated attention, (1+w) norms, Gated DeltaNet shapes."""
    layers = get.int("num_hidden_layers")
    types = d.get("layer_types")
    if types is None:  # transformers derives the pattern from the interval (every n-th layer is full attention)
        interval = get.int("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(types, list):
        raise ModelFormatError(f"{source}: field 'layer_types' is {types!r}; expected a list of layer types; fix the config")
    bad = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if bad:
        raise ModelFormatError(
            f"{source}: field 'layer_types' holds {bad}; expected only {list(LAYER_TYPES)}; fix the config"
        )
    rope = get.mapping("rope_parameters")
    fields: dict[str, Any] = {}
    if any(_is_sparse(d, i) for i in range(layers)):  # sparse MLPs: the Qwen3-MoE block with a shared expert
        from draftflow.layers.moe import moe_fields

        fields = moe_fields(d, source, layers)
    return fields | {
        "layer_types": tuple(types),
        "partial_rotary_factor": (get.nested("rope_parameters").number("partial_rotary_factor") if "partial_rotary_factor" in rope
                                  else get.number("partial_rotary_factor", 0.25)),
        "attn_output_gate": True,
        "norm_offset": True,
        "linear_num_key_heads": get.int("linear_num_key_heads"),
        "linear_num_value_heads": get.int("linear_num_value_heads"),
        "linear_key_head_dim": get.int("linear_key_head_dim"),
        "linear_value_head_dim": get.int("linear_value_head_dim"),
        "linear_conv_kernel": get.int("linear_conv_kernel_dim"),
    }


def _is_sparse(d: dict[str, Any], layer: int) -> bool:
    """transformers' rule: a layer is an MoE block unless listed in mlp_only_layers or off the sparse step."""
    experts, step = int(d.get("num_experts") or 0), int(d.get("decoder_sparse_step") or 1)
    return layer not in (d.get("mlp_only_layers") or []) and experts > 0 and (layer + 1) % step == 0


def normalize_eos(eos: int | list[int] | None) -> tuple[int, ...]:
    """`eos_token_id` may be an int, a list or absent in HF files; always give a tuple."""
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


def _arch_of(d: dict[str, Any], source: str) -> str:
    archs = d.get("architectures") or []
    if not isinstance(archs, list):
        raise ModelFormatError(f"{source}: field 'architectures' is {archs!r}; expected a list such as "
                               "['Qwen3ForCausalLM']; fix the config")
    if archs:
        if isinstance(archs[0], str) and archs[0] in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[archs[0]]
        found = archs[0]
    elif isinstance(d.get("model_type"), str) and d["model_type"] in _MODEL_TYPES:
        return _MODEL_TYPES[d["model_type"]]
    else:
        found = d.get("model_type")
    raise ModelFormatError(
        f"{source}: architecture {found!r} is not supported; expected one of "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}; convert the model to a supported architecture"
    )


def rope_scaling_of(rope: dict[str, Any], get: ConfigFields, d: dict[str, Any], source: str) -> RopeScaling | None:
    """The RoPE scaling of a `rope_scaling` / `rope_parameters` mapping (`get` reads it), or None for default RoPE."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind != "llama3":
        raise ModelFormatError(
            f"{source}: field 'rope_type' is {kind!r}; expected 'default' or 'llama3'; "
            "other RoPE scalings are not supported"
        )
    return RopeScaling(
        rope_type="llama3",
        factor=get.number("factor"),
        low_freq_factor=get.number("low_freq_factor"),
        high_freq_factor=get.number("high_freq_factor"),
        original_max_position_embeddings=(get.int("original_max_position_embeddings") if "original_max_position_embeddings" in rope
                                          else ConfigFields(d, source).int("max_position_embeddings", 8192)),
    )


_MISSING = object()


class ConfigFields:
    """Reads typed config fields, raising one-line errors that name the file and the field.

    A field given as ``null`` counts as absent (HF writes ``"head_dim": null``); a field
    without a default must be present.
    """

    def __init__(self, d: dict[str, Any], source: str, prefix: str = "") -> None:
        self._d, self._source, self._prefix = d, source, prefix

    def _fail(self, key: str, value: Any, expected: str):
        raise ModelFormatError(f"{self._source}: field {self._prefix + key!r} is {value!r}; expected {expected}; fix the config")

    def _absent(self, key: str, default: Any, expected: str) -> bool:
        """Whether the field is absent (or null) and `default` applies; absent without a default fails."""
        if self._d.get(key) is not None:
            return False
        if default is _MISSING:
            self._fail(key, None, expected)
        return True

    def int(self, key: str, default: Any = _MISSING, minimum: int = 1) -> int:
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        if self._absent(key, default, expected):
            return default
        value = self._d[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            self._fail(key, value, expected)
        return value

    def number(self, key: str, default: Any = _MISSING) -> float:
        if self._absent(key, default, "a positive number"):
            return default
        value = self._d[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            self._fail(key, value, "a positive number")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        if self._absent(key, default, "true or false"):
            return default
        value = self._d[key]
        if not isinstance(value, bool):
            self._fail(key, value, "true or false")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        if self._absent(key, {}, "an object"):
            return {}
        value = self._d[key]
        if not isinstance(value, dict):
            self._fail(key, value, "an object (or null)")
        return value

    def nested(self, key: str) -> ConfigFields:
        return ConfigFields(self.mapping(key), self._source, f"{self._prefix}{key}.")

    def token_id(self, key: str) -> int | None:
        return None if self._d.get(key) is None else self.int(key, minimum=0)

    def token_ids(self, key: str) -> tuple[int, ...]:
        """An int, a list of ints, or absent (HF writes all three for `eos_token_id`)."""
        value = self._d.get(key)
        if value is None or isinstance(value, int) and not isinstance(value, bool):
            return normalize_eos(self.token_id(key))
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            self._fail(key, value, "a token id or a list of token ids")
        return tuple(value)


def expected_tensors(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name (as `save_pretrained` writes it) -> shape, for every required weight.

    A tied model has no `lm_head.weight` here; loaders accept one if present.
    """
    h = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        if cfg.is_linear(i):
            out.update(_linear_attention_tensors(cfg, p + "linear_attn."))
        else:
            out.update(_attention_tensors(cfg, p + "self_attn."))
        out[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.is_moe(i):
            from draftflow.layers.moe import moe_tensors

            out.update(moe_tensors(cfg, p + "mlp."))
            continue
        out[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        out[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        out[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    out["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


def _attention_tensors(cfg: TargetConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q_out = q * (2 if cfg.attn_output_gate else 1)  # gated attention: per head [query | gate]
    out = {p + "q_proj.weight": (q_out, h), p + "k_proj.weight": (kv, h), p + "v_proj.weight": (kv, h),
           p + "o_proj.weight": (h, q)}
    if cfg.attention_bias:
        out.update({p + "q_proj.bias": (q_out,), p + "k_proj.bias": (kv,), p + "v_proj.bias": (kv,)})
    if cfg.o_bias:
        out[p + "o_proj.bias"] = (h,)
    if cfg.qk_norm:
        out.update({p + "q_norm.weight": (cfg.head_dim,), p + "k_norm.weight": (cfg.head_dim,)})
    return out


def _linear_attention_tensors(cfg: TargetConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    key, value = cfg.linear_num_key_heads * cfg.linear_key_head_dim, hv * cfg.linear_value_head_dim
    return {
        p + "in_proj_qkvz.weight": (2 * key + 2 * value, h),
        p + "in_proj_ba.weight": (2 * hv, h),
        p + "conv1d.weight": (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel),
        p + "dt_bias": (hv,),
        p + "A_log": (hv,),
        p + "norm.weight": (cfg.linear_value_head_dim,),
        p + "out_proj.weight": (h, value),
    }


def weight_bytes(cfg: TargetConfig, dtype: torch.dtype) -> int:
    """Bytes the weights take on the device in `dtype` (a tied head is counted once)."""
    numel = sum(_prod(shape) for shape in expected_tensors(cfg).values())
    return numel * dtype.itemsize


def kv_bytes_per_token(cfg: TargetConfig, dtype: torch.dtype) -> int:
    """Bytes one token position takes in the KV cache: K and V over all full-attention layers, batch 1."""
    return 2 * cfg.num_kv_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def read_config(path: str | os.PathLike[str]) -> TargetConfig:
    """Parse `path/config.json` only (no weights), e.g. to size allocations first."""
    file = Path(path) / "config.json"
    if not file.exists() and not file.is_symlink():
        raise ModelFormatError(f"{file}: file is missing; expected a JSON file; point at an HF model directory")
    return TargetConfig.from_hf_dict(read_json_object(file), str(file))


# The names these had before they were public (plugins/target imports `_Getter`).
_Getter, _rope_scaling = ConfigFields, rope_scaling_of
