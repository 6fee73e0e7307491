"""The `tokenizer.*` GGUF keys llama.cpp reads, for the converters.

A target file gets them from its HF `tokenizer.json` (a byte-level BPE becomes llama.cpp's
`gpt2` tokenizer model, as `convert_hf_to_gguf.py` writes it). A drafter file carries its
target's keys, as llama.cpp's own drafter files do (llama.cpp refuses a model file without
`tokenizer.ggml.model`): `copy_target_tokenizer` takes them from the target's GGUF (every
`tokenizer.*` key, verbatim) or writes them from the target's HF directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf

from draftflow.core.errors import ModelFormatError
from draftflow.core.files import read_json_object
from draftflow.layers.config import ConfigFields, read_config
from draftflow.plugins.target.gguf_loader import PRE_TOKENIZER_REGEX


def write_tokenizer(writer: gguf.GGUFWriter, file: Path, vocab_size: int, bos_id: int | None,
                    eos_ids: tuple[int, ...]) -> bool:
    """Write the special ids and, from a byte-level BPE `file` (tokenizer.json), llama.cpp's `gpt2` tokenizer.

    Returns whether the tokenizer itself went in (False: the file is missing or not byte-level
    BPE, and only the special ids were written rather than a wrong tokenizer).
    """
    if bos_id is not None:
        writer.add_bos_token_id(bos_id)
    if eos_ids:
        writer.add_eos_token_id(eos_ids[0])
    if len(eos_ids) > 1:  # llama.cpp has one eos; a second stop token goes in as end-of-turn
        writer.add_eot_token_id(eos_ids[1])
    if not file.exists():
        return False
    spec = json.loads(file.read_text(encoding="utf-8"))
    model, pre = spec.get("model") or {}, _pre_name(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or pre is None:
        return False
    vocab: dict[str, int] = dict(model["vocab"])
    special: dict[int, bool] = {}
    for added in spec.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
        special[added["id"]] = bool(added.get("special"))
    size = max(vocab_size, max(vocab.values()) + 1)
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
    return True


def copy_target_tokenizer(writer: gguf.GGUFWriter, target: str | os.PathLike[str], keep: tuple[str, ...] = ()) -> int:
    """Give `writer` the tokenizer keys of `target` (a .gguf file or an HF directory); returns the target's vocab size.

    Keys named in `keep` are the drafter's own (e.g. its mask token id) and are not copied.
    """
    path = Path(target)
    if path.is_dir():
        return _from_hf_dir(writer, path)
    if not path.is_file():
        raise ModelFormatError(f"--target {target}: no such file or directory; expected the target model's .gguf "
                               "file or HF directory; check the path")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError, IndexError, ... on bad bytes
        raise ModelFormatError(f"--target {target}: not a readable GGUF file ({type(exc).__name__}); expected the "
                               "target model's .gguf file or HF directory; check the path") from exc
    if reader.get_field("tokenizer.ggml.model") is None:
        raise ModelFormatError(f"--target {target}: the file has no tokenizer.ggml.model; expected the target model's "
                               "GGUF (the one llama.cpp runs), which carries the tokenizer; pass that file")
    for field in reader.fields.values():
        if field.name.startswith("tokenizer.") and field.name not in keep:
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    return int(embd.shape[-1]) if embd is not None else len(reader.get_field("tokenizer.ggml.tokens").contents())


def _from_hf_dir(writer: gguf.GGUFWriter, root: Path) -> int:
    if not (root / "config.json").is_file():
        raise ModelFormatError(f"--target {root}: the directory has no config.json; expected the target model's "
                               ".gguf file or HF directory; check the path")
    cfg = read_config(root)
    gen_file = root / "generation_config.json"
    gen = read_json_object(gen_file) if gen_file.is_file() else {}
    eos = ConfigFields(gen, str(gen_file)).token_ids("eos_token_id") or cfg.eos_token_ids
    if not write_tokenizer(writer, root / "tokenizer.json", cfg.vocab_size, cfg.bos_token_id, eos):
        raise ModelFormatError(f"--target {root}: no byte-level BPE tokenizer.json in the directory; expected one "
                               "(llama.cpp's gpt2 tokenizer); convert the target with llama.cpp's convert_hf_to_gguf.py "
                               "and pass that .gguf as --target")
    return cfg.vocab_size


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
