"""Convert an HF qwen3 / llama / qwen2 checkpoint directory to a llama.cpp GGUF file.

Names, metadata keys and layouts follow llama.cpp's `convert_hf_to_gguf.py`, so the
output runs in llama.cpp and loads back through `draftflow.plugins.target.gguf_loader`:
llama's attn_q / attn_k rows are permuted to llama.cpp's interleaved RoPE layout, llama3
RoPE scaling becomes a `rope_freqs.weight` tensor, norms and other 1-D tensors stay F32.

    python -m draftflow.tools.convert_gguf HF_DIR OUT.gguf --dtype q8_0

The whole model is read into CPU memory first (float32, or bf16 for --dtype bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import gguf
import torch

from draftflow.layers.config import TargetConfig
from draftflow.core.errors import ModelFormatError
from draftflow.layers.gguf_names import hf_to_gguf_name
from draftflow.plugins.target.gguf_loader import PRE_TOKENIZER_REGEX, llama_permute
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.layers.rope import llama3_freq_factors
from draftflow.layers.gguf_names import GGUF_ARCHS, merged_name, write_moe_metadata

DTYPES = ("f32", "f16", "bf16", "q8_0")
_FILE_TYPE = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}


def convert_hf_to_gguf(hf_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], dtype: str = "f32",
                       expert_layout: str = "merged") -> None:
    """Write `out_path` (GGUF) from the HF directory `hf_dir`, storing 2-D weights as `dtype`.

    MoE experts go out merged per layer (`ffn_*_exps`, what llama.cpp writes today) or, with
    `expert_layout="per-expert"`, one tensor per expert (`ffn_gate.J`, older llama.cpp files).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {', '.join(DTYPES)}")
    # bf16 checkpoints round-trip exactly through bf16; everything else goes via float32.
    loaded = load_hf(hf_dir, "cpu", torch.bfloat16 if dtype == "bf16" else torch.float32)
    cfg = loaded.config
    arch = {v: k for k, v in GGUF_ARCHS.items()}.get(cfg.arch, cfg.arch)  # qwen3_moe -> qwen3moe
    writer = gguf.GGUFWriter(str(out_path), arch)
    _write_metadata(writer, cfg, dtype, arch)
    if cfg.moe_layers:
        write_moe_metadata(writer, arch, cfg)
    _write_tokenizer(writer, Path(hf_dir) / "tokenizer.json", cfg, loaded.eos_ids)
    for name, tensor in loaded.model.state_dict().items():
        if name == "inv_freq":
            continue
        hf_name = name if name.startswith("lm_head.") else "model." + name
        if cfg.arch == "llama" and ".self_attn.q_proj." in hf_name:
            tensor = llama_permute(tensor, cfg.num_heads)
        elif cfg.arch == "llama" and ".self_attn.k_proj." in hf_name:
            tensor = llama_permute(tensor, cfg.num_kv_heads)
        _add_tensor(writer, hf_to_gguf_name(hf_name), tensor, dtype)
    if cfg.moe_layers:
        _add_experts(writer, loaded.model.host_experts, cfg, dtype, expert_layout)
    if cfg.rope_scaling is not None:  # llama3: llama.cpp divides each frequency by these factors
        writer.add_tensor("rope_freqs.weight", llama3_freq_factors(cfg).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_backbone_metadata(writer: gguf.GGUFWriter, a: str, cfg) -> None:
    """The transformer-block keys llama.cpp reads for arch `a` (a target or a DFlash drafter config)."""
    writer.add_uint32(f"{a}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{a}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{a}.block_count", cfg.num_layers)
    writer.add_uint32(f"{a}.attention.head_count", cfg.num_heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", cfg.num_kv_heads)
    writer.add_uint32(f"{a}.attention.key_length", cfg.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", cfg.head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{a}.rope.freq_base", cfg.rope_theta)
    writer.add_uint32(f"{a}.rope.dimension_count", cfg.head_dim)


def _write_metadata(writer: gguf.GGUFWriter, cfg: TargetConfig, dtype: str, arch: str | None = None) -> None:
    a = arch or cfg.arch
    writer.add_uint32(f"{a}.vocab_size", cfg.vocab_size)
    writer.add_uint32(f"{a}.context_length", cfg.max_position_embeddings)
    write_backbone_metadata(writer, a, cfg)
    writer.add_uint32("general.file_type", int(_FILE_TYPE[dtype]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_tensor(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, dtype: str) -> None:
    # 1-D tensors (norms, biases) stay F32, as llama.cpp keeps them.
    if tensor.dim() == 1 or dtype == "f32":
        writer.add_tensor(name, tensor.float().numpy())
    elif dtype == "bf16":
        bits = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        writer.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
    elif dtype == "q8_0" and tensor.shape[-1] % 32 == 0:
        q = gguf.quants.quantize(tensor.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:  # f16, or a Q8_0 row length that is not whole blocks (llama.cpp falls back the same way)
        writer.add_tensor(name, tensor.to(torch.float16).numpy())


def _write_tokenizer(writer: gguf.GGUFWriter, file: Path, cfg: TargetConfig, eos_ids: tuple[int, ...]) -> None:
    """Embed a byte-level BPE tokenizer.json as llama.cpp's `gpt2` tokenizer model."""
    if cfg.bos_token_id is not None:
        writer.add_bos_token_id(cfg.bos_token_id)
    if eos_ids:
        writer.add_eos_token_id(eos_ids[0])
    if len(eos_ids) > 1:  # llama.cpp has one eos; a second stop token goes in as end-of-turn
        writer.add_eot_token_id(eos_ids[1])
    if not file.exists():
        return
    spec = json.loads(file.read_text(encoding="utf-8"))
    model, pre = spec.get("model") or {}, _pre_name(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or pre is None:
        return  # not byte-level BPE: leave the tokenizer out rather than embed a wrong one
    vocab: dict[str, int] = dict(model["vocab"])
    special: dict[int, bool] = {}
    for added in spec.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
        special[added["id"]] = bool(added.get("special"))
    size = max(cfg.vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = gguf.TokenType.NORMAL
    for i, is_special in special.items():
        types[i] = gguf.TokenType.CONTROL if is_special else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    if merges:
        writer.add_token_merges(merges)
    writer.add_add_bos_token(_adds_bos(spec))


def _pre_name(pre: dict[str, Any] | None) -> str | None:
    """llama.cpp pre-tokenizer name for a tokenizer.json pre_tokenizer, or None if unknown."""
    if not pre:
        return None
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if pre.get("type") != "Sequence":
        return None
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2 or steps[1].get("type") != "ByteLevel" or steps[0].get("type") != "Split":
        return None
    pattern = (steps[0].get("pattern") or {}).get("Regex")
    return next((name for name, regex in PRE_TOKENIZER_REGEX.items() if regex == pattern), None)


def _adds_bos(spec: dict[str, Any]) -> bool:
    post = spec.get("post_processor") or {}
    steps = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    return any(s.get("type") == "TemplateProcessing" and s.get("single", [{}])[0].get("SpecialToken") for s in steps)


def _add_experts(writer: gguf.GGUFWriter, host, cfg: TargetConfig, dtype: str, layout: str) -> None:
    """Routed experts from the host stacks: merged [E, out, in] per layer and part, or one tensor per expert."""
    i = cfg.moe_intermediate_size
    for row, layer in enumerate(host.layers):
        parts = {"gate_proj": host.gate_up[row, :, :i], "up_proj": host.gate_up[row, :, i:], "down_proj": host.down[row]}
        for part, stack in parts.items():
            if layout == "merged":
                _add_tensor(writer, merged_name(layer, part), stack.contiguous(), dtype)
            else:
                for j in range(cfg.num_experts):
                    name = hf_to_gguf_name(f"model.layers.{layer}.mlp.experts.{j}.{part}.weight")
                    _add_tensor(writer, name, stack[j].contiguous(), dtype)


def main(argv: list[str] | None = None) -> int:
    """CLI: `python -m draftflow.tools.convert_gguf HF_DIR OUT.gguf --dtype q8_0`."""
    parser = argparse.ArgumentParser(prog="python -m draftflow.tools.convert_gguf", description=__doc__.split("\n")[0])
    parser.add_argument("hf_dir", help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("out", help="output .gguf path")
    parser.add_argument("--dtype", choices=DTYPES, default="f32", help="storage type of 2-D weights")
    parser.add_argument("--expert-layout", choices=("merged", "per-expert"), default="merged",
                        help="MoE: llama.cpp's merged ffn_*_exps tensors, or one tensor per expert")
    args = parser.parse_args(argv)
    try:
        convert_hf_to_gguf(args.hf_dir, args.out, args.dtype, args.expert_layout)
    except ModelFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
