"""llama.cpp names and metadata of MoE targets (`qwen3moe`): the GGUF side of moe.py.

llama.cpp stores a layer's routed experts merged, as `blk.N.ffn_{gate,up,down}_exps.weight`
(torch shapes [E, I, H], [E, I, H], [E, H, I]; ne order reversed), the router as
`blk.N.ffn_gate_inp.weight` [E, H], and a shared expert as `*_shexp` with its gate
`ffn_gate_inp_shexp` [H]. Older files hold one tensor per expert, `blk.N.ffn_gate.J.weight`;
both load. Metadata: `{arch}.expert_count`, `expert_used_count`,
`expert_feed_forward_length`, `expert_shared_feed_forward_length`; `expert_weights_norm`
(absent = true: llama.cpp's qwen3moe graph always renormalises the top-k weights).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from draftflow.core.errors import ModelFormatError

GGUF_ARCHS = {"qwen3moe": "qwen3_moe"}  # GGUF general.architecture -> TargetConfig.arch
MOE_LAYER_NAMES = {  # HF module suffix inside `model.layers.N.` -> llama.cpp suffix inside `blk.N.`
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_PART = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MERGED = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


def expert_gguf_name(hf_name: str) -> str | None:
    """Per-expert llama.cpp name of a routed expert weight (`blk.N.ffn_gate.J.weight`), else None."""
    m = _EXPERT.match(hf_name)
    return f"blk.{m[1]}.{_PART[m[3]]}.{m[2]}.weight" if m else None


def merged_name(layer: int, part: str) -> str:
    """`blk.N.ffn_gate_exps.weight` for part `gate_proj` / `up_proj` / `down_proj`."""
    return f"blk.{layer}.{_PART[part]}_exps.weight"


def merged_views(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, int]]:
    """HF per-expert name -> (merged GGUF tensor, expert index), for every merged expert tensor in `shapes` (torch order)."""
    views = {}
    for name, shape in shapes.items():
        m = _MERGED.match(name)
        if m:
            for j in range(shape[0]):
                views[f"model.layers.{m[1]}.mlp.experts.{j}.{m[2]}_proj.weight"] = (name, j)
    return views


def gguf_moe_fields(value: Callable[[str], Any], tensor_names, arch: str, num_layers: int, source: str) -> dict:
    """TargetConfig MoE fields from GGUF metadata; MoE layers are those with a router tensor."""
    out = {}
    for field, key in (("num_experts", "expert_count"), ("num_experts_per_tok", "expert_used_count"),
                       ("moe_intermediate_size", "expert_feed_forward_length")):
        v = value(f"{arch}.{key}")
        if v is None:
            raise ModelFormatError(f"{source}: metadata key '{arch}.{key}' is missing; expected it for an MoE model; "
                                   "re-convert the model")
        out[field] = int(v)
    norm = value(f"{arch}.expert_weights_norm")
    out["norm_topk_prob"] = True if norm is None else bool(norm)
    out["moe_layers"] = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names)
    out["shared_expert_intermediate_size"] = int(value(f"{arch}.expert_shared_feed_forward_length") or 0)
    return out


def write_moe_metadata(writer, arch: str, cfg) -> None:
    """The MoE keys llama.cpp reads, plus `expert_weights_norm` so a non-renormalising model round-trips."""
    writer.add_uint32(f"{arch}.expert_count", cfg.num_experts)
    writer.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
    writer.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
    writer.add_bool(f"{arch}.expert_weights_norm", cfg.norm_topk_prob)
    if cfg.shared_expert_intermediate_size:
        writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)


# HF module suffix inside `model.layers.N.` -> llama.cpp suffix inside `blk.N.`.
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    **MOE_LAYER_NAMES,
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def hf_to_gguf_name(hf_name: str) -> str:
    """`model.layers.3.self_attn.q_proj.bias` -> `blk.3.attn_q.bias` (and the top-level names)."""
    stem, _, kind = hf_name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{kind}"
    expert = expert_gguf_name(hf_name)
    if expert is not None:
        return expert
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"
