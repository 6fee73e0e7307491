"""Convert DFlash and DFlash2 drafters between z-lab Hugging Face directories and GGUF, losslessly.

    python -m draftflow.tools.convert_dflash DRAFTER_DIR out.gguf --target TARGET [--names hf]
    python -m draftflow.tools.convert_dflash drafter.gguf OUT_DIR

HF -> GGUF writes llama.cpp's `dflash` architecture: `blk.N.*` / `enc.output_norm` /
`output_norm` names (or raw HF names with `--names hf`), `dflash.target_layers` = ids + 1,
the mask id as `tokenizer.ggml.mask_token_id`. Matrices keep their dtype (F32, F16,
BF16); 1-D tensors are stored as F32 as llama.cpp expects, and `general.file_type`
records the original dtype so GGUF -> HF restores them bit for bit. DFlash2 artifacts are
recognised by themselves (HF `architectures`, or `selector_hidden.weight` in the GGUF) and
add `dflash.conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`.

`--target` (the target model's .gguf, or its HF directory) copies the target's tokenizer
keys (`tokenizer.ggml.model`, tokens, token types, merges, special ids, pre-tokenizer, ...)
into the drafter file, as llama.cpp's own drafter files carry them: llama.cpp refuses a
model file without them (`key not found in model: tokenizer.ggml.model`). draftflow itself
does not need them (the drafter uses the target's tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import gguf
import torch
from safetensors.torch import save_file

from draftflow.core.errors import ModelFormatError
from draftflow.plugins.dflash.config import DFlashConfig
from draftflow.plugins.dflash.loader import GGUF_ARCH, hf_to_gguf_name, is_gguf, read_artifact
from draftflow.plugins.dflash import dflash2_loader
from draftflow.tools.convert_gguf import write_backbone_metadata
from draftflow.tools.gguf_tokenizer import copy_target_tokenizer
from draftflow.plugins.dflash.dflash2_config import CODEBOOKS, EXTRA_KEYS

EPILOG = """\
llama.cpp loads a drafter GGUF only with its target's tokenizer keys in it: pass --target
(the target's .gguf file, or its HF directory with a byte-level BPE tokenizer.json):
  python -m draftflow.tools.convert_dflash DRAFTER_DIR drafter.gguf --target target.gguf
Without --target the file loads in draftflow but llama.cpp refuses it
(key not found in model: tokenizer.ggml.model).
"""
_FILE_TYPE = {torch.float32: gguf.LlamaFileType.ALL_F32, torch.float16: gguf.LlamaFileType.MOSTLY_F16,
              torch.bfloat16: gguf.LlamaFileType.MOSTLY_BF16}


def hf_to_gguf(src: str | os.PathLike[str], out: str | os.PathLike[str], names: str = "llama",
               target: str | os.PathLike[str] | None = None) -> None:
    """Write `out` (GGUF) from the z-lab directory `src`; `names` is 'llama' (llama.cpp) or 'hf'.

    A DFlash2 directory (architectures DFlash2DraftModel) also gets its convolution and
    selector tensors (`blk.N.attn_conv_base`, `selector_hidden.weight`, ...) and keys.
    `target` (a .gguf file or HF directory) supplies the tokenizer keys llama.cpp needs.
    """
    is_v2 = dflash2_loader.is_dflash2(src)
    art = dflash2_loader.read_artifact(src) if is_v2 else read_artifact(src)
    cfg = art.config.base if is_v2 else art.config
    if cfg.rope_scaling is not None:
        raise ModelFormatError(f"{src}: RoPE scaling is not supported in DFlash GGUF files; keep the HF directory")
    writer = gguf.GGUFWriter(str(out), GGUF_ARCH)
    write_metadata(writer, cfg, art.file_dtype)
    if is_v2:
        for key in EXTRA_KEYS:
            writer.add_uint32(f"{GGUF_ARCH}.{key}", getattr(art.config, key))
    if target is not None:
        _copy_tokenizer(writer, target, cfg, str(src))
    to_llama = dflash2_loader.hf_to_gguf_name if is_v2 else hf_to_gguf_name
    for name, tensor in art.tensors.items():
        gname = to_llama(name) if names == "llama" else name
        if tensor.dim() == 1 or tensor.dtype == torch.float32:
            writer.add_tensor(gname, tensor.float().numpy())
        elif tensor.dtype == torch.bfloat16:
            writer.add_tensor(gname, tensor.contiguous().view(torch.int16).numpy(), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(gname, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _copy_tokenizer(writer: gguf.GGUFWriter, target, cfg: DFlashConfig, src: str) -> None:
    """The target's tokenizer keys, after checking the drafter was made for that vocabulary."""
    vocab = copy_target_tokenizer(writer, target, keep=("tokenizer.ggml.mask_token_id",))
    if cfg.vocab_size is not None and cfg.vocab_size != vocab:
        raise ModelFormatError(f"--target {target}: the target's vocabulary has {vocab} tokens but the drafter {src} "
                               f"has vocab_size {cfg.vocab_size}; expected the target the drafter was trained for; "
                               "pass that target")
    if cfg.mask_token_id >= vocab:
        raise ModelFormatError(f"--target {target}: the drafter's mask_token_id {cfg.mask_token_id} is outside the "
                               f"target's {vocab}-token vocabulary; expected the target the drafter was trained for; "
                               "pass that target")


def gguf_to_hf(src: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> None:
    """Write a z-lab directory (config.json + model.safetensors) from the GGUF `src`."""
    is_v2 = dflash2_loader.is_dflash2(src)
    art = dflash2_loader.read_artifact(src) if is_v2 else read_artifact(src)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: (t.to(art.file_dtype) if t.dim() == 1 else t).contiguous() for n, t in art.tensors.items()}
    if is_v2:  # published DFlash2 checkpoints store the codebooks without `.weight`
        tensors = {n.removesuffix(".weight") if n.removesuffix(".weight") in CODEBOOKS else n: t
                   for n, t in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    d = art.config.to_hf_dict()
    d["dtype"] = str(art.file_dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")


def write_metadata(writer: gguf.GGUFWriter, cfg: DFlashConfig, file_dtype: torch.dtype) -> None:
    """The `dflash.*` GGUF metadata of `cfg` (llama.cpp keys; tap layers stored as ids + 1)."""
    a = GGUF_ARCH
    write_backbone_metadata(writer, a, cfg)
    writer.add_uint32(f"{a}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{a}.block_size", cfg.block_size)
    # llama.cpp counts taps as inputs of layer L+1; the HF ids are outputs of layer L.
    writer.add_array(f"{a}.target_layers", [i + 1 for i in cfg.target_layer_ids])
    writer.add_uint32("tokenizer.ggml.mask_token_id", cfg.mask_token_id)
    if cfg.num_target_layers is not None:
        writer.add_uint32(f"{a}.num_target_layers", cfg.num_target_layers)
    if cfg.vocab_size is not None:
        writer.add_uint32(f"{a}.vocab_size", cfg.vocab_size)
    if cfg.layer_types:
        writer.add_array(f"{a}.attention.sliding_window_pattern", [t == "sliding_attention" for t in cfg.layer_types])
    if cfg.sliding_window is not None:
        writer.add_uint32(f"{a}.attention.sliding_window", cfg.sliding_window)
    if cfg.is_causal is not None:
        writer.add_bool(f"{a}.attention.causal", cfg.is_causal)
    if cfg.input_embedding_scale != 1.0:
        writer.add_float32(f"{a}.embedding_scale", cfg.input_embedding_scale)
    if cfg.output_multiplier != 1.0:
        writer.add_float32(f"{a}.logit_scale", cfg.output_multiplier)
    if cfg.final_logit_softcapping:
        writer.add_float32(f"{a}.final_logit_softcapping", cfg.final_logit_softcapping)
    writer.add_uint32("general.file_type", int(_FILE_TYPE[file_dtype]))


def main(argv: list[str] | None = None) -> int:
    """CLI: the direction follows the source (a directory -> GGUF, a .gguf file -> directory)."""
    parser = argparse.ArgumentParser(prog="python -m draftflow.tools.convert_dflash", description=__doc__.split("\n")[0],
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="z-lab DFlash / DFlash2 directory or .gguf file")
    parser.add_argument("out", help="output .gguf file (from a directory) or directory (from a .gguf)")
    parser.add_argument("--names", choices=("llama", "hf"), default="llama",
                        help="GGUF tensor names: llama.cpp's (default) or the raw Hugging Face names")
    parser.add_argument("--target", metavar="DIR_OR_GGUF",
                        help="directory -> GGUF: the target model (its .gguf or HF directory) whose tokenizer keys "
                             "the drafter file carries; llama.cpp needs them, draftflow does not")
    args = parser.parse_args(argv)
    if args.target is not None and is_gguf(args.src):
        print(f"error: --target {args.target}: applies to directory -> GGUF only, and {args.src} is a GGUF file; "
              "drop --target", file=sys.stderr)
        return 1
    try:
        if is_gguf(args.src):
            gguf_to_hf(args.src, args.out)
        else:
            hf_to_gguf(args.src, args.out, args.names, args.target)
    except ModelFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.target is None and not is_gguf(args.src):
        print(f"note: {args.out} has no tokenizer keys, so llama.cpp refuses it (draftflow loads it); add --target "
              "TARGET (the target's .gguf or HF directory) to copy them", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
