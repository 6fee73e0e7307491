"""Convert an HF qwen3 / llama / qwen2 / qwen3_moe checkpoint directory to a llama.cpp GGUF file.

Names, metadata keys, layouts and per-tensor types follow llama.cpp, so the output runs in
llama.cpp and loads back through `draftflow.plugins.target.gguf_loader`: llama's attn_q /
attn_k rows are permuted to llama.cpp's interleaved RoPE layout, llama3 RoPE scaling
becomes a `rope_freqs.weight` tensor.

    python -m draftflow.tools.convert_gguf HF_DIR OUT.gguf --outtype q8_0

Which tensors get `--outtype` is what llama.cpp decides: 1-D tensors (norms, biases) and
the MoE router `ffn_gate_inp` are always F32; a row that is not whole quantization blocks
falls back to F16 (`convert_hf_to_gguf.py`). f32/f16/bf16/q8_0 write what
`convert_hf_to_gguf.py --outtype` writes. q4_0/q4_1/q5_0/q5_1 and the K-quant mixes
q4_k_m/q5_k_m/q6_k follow `llama-quantize F16.gguf OUT.gguf TYPE`'s main per-tensor rules:
the output head (`output.weight`, or `token_embd.weight` when tied) is Q6_K; under the _M
mixes `attn_v` and `ffn_down` are Q6_K in the first and last eighth of the layers and every
third layer between; a row that is not whole 256-weight blocks takes llama-quantize's
fallback (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0). K-quant blocks come from our own
quantizer (`tools/kquants.py`, the gguf package has none), the rest from gguf's.

The whole model is read into CPU memory first, in float32 (4 bytes per weight), so the tensors
kept F32 hold the checkpoint's exact values whatever --outtype, as llama.cpp's do.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gguf
import torch

from draftflow.layers.config import TargetConfig
from draftflow.core.errors import ModelFormatError
from draftflow.layers.gguf_names import hf_to_gguf_name
from draftflow.plugins.target.gguf_loader import llama_permute
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.layers.rope import llama3_freq_factors
from draftflow.layers.gguf_names import GGUF_ARCHS, merged_name, write_moe_metadata
from draftflow.tools.gguf_tokenizer import write_tokenizer
from draftflow.tools.kquants import quantize_k

_Q = gguf.GGMLQuantizationType
QUANTIZED = {"q8_0": _Q.Q8_0, "q4_0": _Q.Q4_0, "q4_1": _Q.Q4_1, "q5_0": _Q.Q5_0, "q5_1": _Q.Q5_1,
             "q4_k_m": _Q.Q4_K, "q5_k_m": _Q.Q5_K, "q6_k": _Q.Q6_K}  # --outtype -> its base tensor type
DTYPES = ("f32", "f16", "bf16", *QUANTIZED)
K_QUANTS = {_Q.Q4_K: "Q4_K", _Q.Q5_K: "Q5_K", _Q.Q6_K: "Q6_K"}
FALLBACK = {_Q.Q4_K: _Q.Q5_0, _Q.Q5_K: _Q.Q5_1, _Q.Q6_K: _Q.Q8_0}  # llama-quantize, for rows not whole 256-blocks
_FILE_TYPE = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "q5_k_m": gguf.LlamaFileType.MOSTLY_Q5_K_M,
    "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
}
EPILOG = """\
Other K-quant mixes (Q2_K, Q3_K_*, Q4_K_S, ...) and IQ types: convert to F16 (or BF16) with
draftflow, then quantize with llama.cpp's llama-quantize (with an importance matrix if you have one):
  python -m draftflow.tools.convert_gguf HF_DIR model-f16.gguf --outtype f16
  llama-quantize model-f16.gguf model-Q3_K_M.gguf Q3_K_M
"""


def convert_hf_to_gguf(hf_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], dtype: str = "f32",
                       expert_layout: str = "merged") -> None:
    """Write `out_path` (GGUF) from the HF directory `hf_dir`, storing weight matrices as `dtype` (see DTYPES).

    MoE experts go out merged per layer (`ffn_*_exps`, what llama.cpp writes today) or, with
    `expert_layout="per-expert"`, one tensor per expert (`ffn_gate.J`, older llama.cpp files).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {', '.join(DTYPES)}")
    # float32 holds every checkpoint dtype exactly; matrices are rounded once, when written.
    loaded = load_hf(hf_dir, "cpu", torch.float32)
    cfg = loaded.config
    arch = {v: k for k, v in GGUF_ARCHS.items()}.get(cfg.arch, cfg.arch)  # qwen3_moe -> qwen3moe
    writer = gguf.GGUFWriter(str(out_path), arch)
    _write_metadata(writer, cfg, dtype, arch)
    if cfg.moe_layers:
        write_moe_metadata(writer, arch, cfg)
    write_tokenizer(writer, Path(hf_dir) / "tokenizer.json", cfg.vocab_size, cfg.bos_token_id, loaded.eos_ids)
    for name, tensor in loaded.model.state_dict().items():
        if name == "inv_freq":
            continue
        hf_name = name if name.startswith("lm_head.") else "model." + name
        if cfg.arch == "llama" and ".self_attn.q_proj." in hf_name:
            tensor = llama_permute(tensor, cfg.num_heads)
        elif cfg.arch == "llama" and ".self_attn.k_proj." in hf_name:
            tensor = llama_permute(tensor, cfg.num_kv_heads)
        gname = hf_to_gguf_name(hf_name)
        _add_tensor(writer, gname, tensor, _tensor_dtype(gname, dtype, cfg.tie_word_embeddings, cfg.num_layers))
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


def use_more_bits(index: int, count: int) -> bool:
    """llama-quantize's layers that get more bits under the _M mixes: the first and last eighth, every third between."""
    return index < count // 8 or index >= 7 * count // 8 or (index - count // 8) % 3 == 2


def _tensor_dtype(name: str, dtype: str, tied: bool, num_layers: int = 1) -> str:
    """The type of one weight matrix under --outtype ``dtype`` (before the whole-blocks fallback)."""
    head = name == "output.weight" or (tied and name == "token_embd.weight")
    if dtype not in QUANTIZED or dtype == "q8_0":
        return dtype
    if head:
        return "q6_k"
    if dtype.endswith("_k_m") and name.startswith("blk.") and (".attn_v." in name or ".ffn_down" in name):
        if use_more_bits(int(name.split(".")[1]), num_layers):
            return "q6_k"
    return dtype


def _block_type(dtype: str, row: int):
    """The GGML type a row of ``row`` weights is stored in under the quantized ``dtype``; None: F16."""
    kind = QUANTIZED[dtype]
    if kind in FALLBACK and row % gguf.GGML_QUANT_SIZES[kind][0]:
        kind = FALLBACK[kind]
    return kind if row % gguf.GGML_QUANT_SIZES[kind][0] == 0 else None


def _add_tensor(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, dtype: str) -> None:
    # llama.cpp keeps 1-D tensors (norms, biases), the MoE router and non-`.weight` tensors F32.
    if (tensor.dim() == 1 or dtype == "f32" or name.endswith("_norm.weight") or not name.endswith(".weight")
            or name.endswith(".ffn_gate_inp.weight")):
        writer.add_tensor(name, tensor.float().numpy())
    elif dtype == "bf16":
        bits = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        writer.add_tensor(name, bits, raw_dtype=_Q.BF16)
    elif dtype in QUANTIZED and (kind := _block_type(dtype, tensor.shape[-1])) is not None:
        rows = tensor.float().numpy()
        q = quantize_k(rows, K_QUANTS[kind]) if kind in K_QUANTS else gguf.quants.quantize(rows, kind)
        writer.add_tensor(name, q, raw_dtype=kind)
    else:  # f16, or a row that is not whole blocks (llama.cpp's converter falls back to F16 the same way)
        writer.add_tensor(name, tensor.to(torch.float16).numpy())


def _add_experts(writer: gguf.GGUFWriter, host, cfg: TargetConfig, dtype: str, layout: str) -> None:
    """Routed experts from the host stacks: merged [E, out, in] per layer and part, or one tensor per expert."""
    i = cfg.moe_intermediate_size
    for row, layer in enumerate(host.layers):
        parts = {"gate_proj": host.gate_up[row, :, :i], "up_proj": host.gate_up[row, :, i:], "down_proj": host.down[row]}
        for part, stack in parts.items():
            if layout == "merged":
                name = merged_name(layer, part)
                _add_tensor(writer, name, stack.contiguous(), _tensor_dtype(name, dtype, False, cfg.num_layers))
            else:
                for j in range(cfg.num_experts):
                    name = hf_to_gguf_name(f"model.layers.{layer}.mlp.experts.{j}.{part}.weight")
                    _add_tensor(writer, name, stack[j].contiguous(), _tensor_dtype(name, dtype, False, cfg.num_layers))


def main(argv: list[str] | None = None) -> int:
    """CLI: `python -m draftflow.tools.convert_gguf HF_DIR OUT.gguf --outtype q8_0`."""
    parser = argparse.ArgumentParser(prog="python -m draftflow.tools.convert_gguf", description=__doc__.split("\n")[0],
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("out", help="output .gguf path")
    parser.add_argument("--outtype", "--dtype", dest="dtype", choices=DTYPES, default="f32",
                        metavar="TYPE", help=f"storage type of the weight matrices: {', '.join(DTYPES)} (default f32; "
                        "norms and the MoE router stay F32; q4_*/q5_*/q6_k write the output head Q6_K)")
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
