"""Target-model configuration: the architecture facts every other module reads.

`TargetConfig` is built once from a Hugging Face `config.json` dict (or from GGUF
metadata by the GGUF loader) and never changes. `expected_tensors` is the single
source of truth for which weights a checkpoint must hold and with which shapes.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from draftflow.plugins.target.errors import ModelFormatError

# HF `architectures[0]` and `model_type` spellings -> our arch name.
SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama", "qwen2": "qwen2"}


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
    """Shapes and numerics of a decoder-only target model (qwen3, llama or qwen2)."""

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

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelFormatError(
                f"{self.source}: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; expected a whole GQA ratio; fix the config"
            )
        if self.head_dim % 2:
            raise ModelFormatError(
                f"{self.source}: head_dim={self.head_dim} is odd; expected an even RoPE dimension; fix the config"
            )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str) -> TargetConfig:
        """Build from a parsed HF `config.json`; `source` names the file in error messages."""
        arch = _arch_of(d, source)
        get = _Getter(d, source)
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
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        bias = bool(d.get("attention_bias", False))
        eos = d.get("eos_token_id")
        return cls(
            arch=arch,
            vocab_size=get.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get.int("intermediate_size"),
            num_layers=get.int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=_rope_scaling(rope, d, source),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bias,
            o_bias=False if arch == "qwen2" else bias,
            qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=normalize_eos(eos),
            source=source,
        )


def normalize_eos(eos: int | list[int] | None) -> tuple[int, ...]:
    """`eos_token_id` may be an int, a list or absent in HF files; always give a tuple."""
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


def _arch_of(d: dict[str, Any], source: str) -> str:
    archs = d.get("architectures") or []
    if archs:
        if archs[0] in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[archs[0]]
        found = archs[0]
    elif d.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[d["model_type"]]
    else:
        found = d.get("model_type")
    raise ModelFormatError(
        f"{source}: architecture {found!r} is not supported; expected one of "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}; convert the model to a supported architecture"
    )


def _rope_scaling(rope: dict[str, Any], d: dict[str, Any], source: str) -> RopeScaling | None:
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
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(
            rope.get("original_max_position_embeddings", d.get("max_position_embeddings", 8192))
        ),
    )


class _Getter:
    """Reads required integer fields, raising one-line errors that name the field."""

    def __init__(self, d: dict[str, Any], source: str) -> None:
        self._d, self._source = d, source

    def int(self, key: str) -> int:
        value = self._d.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelFormatError(
                f"{self._source}: field {key!r} is {value!r}; expected a positive integer; fix the config"
            )
        return value


def expected_tensors(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name (as `save_pretrained` writes it) -> shape, for every required weight.

    A tied model has no `lm_head.weight` here; loaders accept one if present.
    """
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (q, h)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        if cfg.attention_bias:
            out[p + "self_attn.q_proj.bias"] = (q,)
            out[p + "self_attn.k_proj.bias"] = (kv,)
            out[p + "self_attn.v_proj.bias"] = (kv,)
        if cfg.o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            out[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        out[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        out[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    out["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


def weight_bytes(cfg: TargetConfig, dtype: torch.dtype) -> int:
    """Bytes the weights take on the device in `dtype` (a tied head is counted once)."""
    numel = sum(_prod(shape) for shape in expected_tensors(cfg).values())
    return numel * dtype.itemsize


def kv_bytes_per_token(cfg: TargetConfig, dtype: torch.dtype) -> int:
    """Bytes one token position takes in the KV cache: K and V over all layers, batch 1."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
