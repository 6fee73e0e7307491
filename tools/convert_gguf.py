"""Convert an HF qwen3 / llama / qwen2 / qwen3_moe checkpoint directory to a llama.cpp GGUF file.

Names, metadata keys, layouts and per-tensor types follow llama.cpp, so the output runs in
llama.cpp and loads back through `draftflow.plugins.target.gguf_loader`: llama's attn_q /
attn_k rows are permuted to llama.cpp's interleaved RoPE layout, llama3 RoPE scaling
becomes a `rope_freqs.weight` tensor.

    python -m draftflow.tools.convert_gguf HF_DIR OUT.gguf --outtype q8_0

Which tensors get `--outtype` is what llama.cpp decides: 1-D tensors (norms, biases) and
the MoE router `ffn_gate_inp` are always F32; a row that is not whole quantization blocks
falls back to F16 (`convert_hf_to_gguf.py`). f32/f16/bf16/q8_0 write what
`convert_hf_to_gguf.py --outtype` writes. q4_0/q4_1/q5_0/q5_1 are what
`llama-quantize F16.gguf OUT.gguf Q4_0` writes, except the output head (`output.weight`,
or `token_embd.weight` when tied): llama-quantize stores it Q6_K, which the `gguf` package
cannot quantize, so it goes out Q8_0 (a little larger, at least as accurate).

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

_Q = gguf.GGMLQuantizationType
QUANTIZED = {"q8_0": _Q.Q8_0, "q4_0": _Q.Q4_0, "q4_1": _Q.Q4_1, "q5_0": _Q.Q5_0, "q5_1": _Q.Q5_1}
DTYPES = ("f32", "f16", "bf16", *QUANTIZED)
_FILE_TYPE = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
}
EPILOG = """\
k-quants (Q4_K_M, Q5_K_M, Q6_K, ...) and IQ types: the gguf package has no quantizer for
them. Convert to F16 (or BF16) with draftflow, then quantize with llama.cpp's llama-quantize:
  python -m draftflow.tools.convert_gguf HF_DIR model-f16.gguf --outtype f16
  llama-quantize model-f16.gguf model-Q4_K_M.gguf Q4_K_M
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
        _add_tensor(writer, gname, tensor, _tensor_dtype(gname, dtype, cfg.tie_word_embeddings))
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


def _tensor_dtype(name: str, dtype: str, tied: bool) -> str:
    """The output head goes Q8_0 under the 4/5-bit types (llama-quantize: Q6_K, which gguf cannot write)."""
    head = name == "output.weight" or (tied and name == "token_embd.weight")
    return "q8_0" if head and dtype in QUANTIZED else dtype


def _add_tensor(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, dtype: str) -> None:
    # llama.cpp keeps 1-D tensors (norms, biases), the MoE router and non-`.weight` tensors F32.
    if (tensor.dim() == 1 or dtype == "f32" or name.endswith("_norm.weight") or not name.endswith(".weight")
            or name.endswith(".ffn_gate_inp.weight")):
        writer.add_tensor(name, tensor.float().numpy())
    elif dtype == "bf16":
        bits = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        writer.add_tensor(name, bits, raw_dtype=_Q.BF16)
    elif dtype in QUANTIZED and tensor.shape[-1] % gguf.GGML_QUANT_SIZES[QUANTIZED[dtype]][0] == 0:
        q = gguf.quants.quantize(tensor.float().numpy(), QUANTIZED[dtype])
        writer.add_tensor(name, q, raw_dtype=QUANTIZED[dtype])
    else:  # f16, or a row that is not whole blocks (llama.cpp's converter falls back to F16 the same way)
        writer.add_tensor(name, tensor.to(torch.float16).numpy())


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
    """CLI: `python -m draftflow.tools.convert_gguf HF_DIR OUT.gguf --outtype q8_0`."""
    parser = argparse.ArgumentParser(prog="python -m draftflow.tools.convert_gguf", description=__doc__.split("\n")[0],
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("out", help="output .gguf path")
    parser.add_argument("--outtype", "--dtype", dest="dtype", choices=DTYPES, default="f32",
                        metavar="TYPE", help=f"storage type of the weight matrices: {', '.join(DTYPES)} (default f32; "
                        "norms and the MoE router stay F32; q4_*/q5_* write the output head Q8_0)")
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
