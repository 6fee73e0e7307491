"""Broken checkpoints fail with one-line ModelFormatErrors that name the file and tensor."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from draftflow.core.errors import ModelFormatError
from draftflow.plugins.target.gguf_loader import load_gguf
from draftflow.plugins.target.hf_loader import load_hf, read_config
from draftflow.tools import convert_gguf


def _edit_weights(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _single_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_unsupported_architecture(hf_dir):
    """config.json with an unsupported architecture names it and the supported ones."""
    _, path = hf_dir("qwen3")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GemmaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=r"architecture 'GemmaForCausalLM' is not supported; expected one "
                       r"of Qwen3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM") as exc:
        read_config(path)
    assert str(path / "config.json") in _single_line(exc)


def test_truncated_safetensors(hf_dir):
    """A truncated safetensors file is reported by file name as truncated or corrupt."""
    _, path = hf_dir("qwen3")
    file = path / "model.safetensors"
    os.truncate(file, file.stat().st_size - 100)
    with pytest.raises(ModelFormatError, match=r"model.safetensors: not a readable safetensors file .*truncated "
                       r"or corrupt") as exc:
        load_hf(path, "cpu", torch.float32)
    _single_line(exc)


def test_missing_tensor(hf_dir):
    """A missing weight is named with its expected shape."""
    _, path = hf_dir("qwen3")
    _edit_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ModelFormatError, match=r"1 weight problem\(s\).*tensor "
                       r"'model.layers.1.self_attn.k_norm.weight' is missing \(expected shape \[16\]\)"):
        load_hf(path, "cpu", torch.float32)


def test_extra_tensor(hf_dir):
    """A tensor the architecture does not have is named as extra, with its file."""
    _, path = hf_dir("llama")
    _edit_weights(path, lambda t: t.update({"model.layers.0.self_attn.rotary.weight": torch.zeros(3)}))
    with pytest.raises(ModelFormatError, match=r"model.safetensors: tensor 'model.layers.0.self_attn.rotary.weight' "
                       r"is not part of a llama model \(extra tensor\)"):
        load_hf(path, "cpu", torch.float32)


def test_mis_shaped_tensor_from_config_disagreement(hf_dir):
    """A config that disagrees with the weights surfaces as mis-shaped tensors with both shapes."""
    _, path = hf_dir("qwen2")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=r"6 weight problem\(s\).*tensor 'model.layers.0.mlp.gate_proj.weight' "
                       r"has shape \[96, 64\], expected \[128, 64\].*; and 1 more; fix: make the config match") as exc:
        load_hf(path, "cpu", torch.float32)
    _single_line(exc)


def test_missing_weights_file(hf_dir):
    """A directory with config.json but no safetensors says how to save one."""
    _, path = hf_dir("qwen3")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match=r"neither model.safetensors nor model.safetensors.index.json exists"):
        load_hf(path, "cpu", torch.float32)


def test_unsupported_gguf_type(hf_dir, tmp_path, monkeypatch):
    """An IQ1_S tensor in a GGUF file is refused naming the tensor, the type and the supported types."""
    _, path = hf_dir("qwen3")
    original = convert_gguf._add_tensor

    def iq1_for_one(writer, name, tensor, dtype):
        if name != "blk.0.ffn_up.weight":
            return original(writer, name, tensor, dtype)
        blocks = np.zeros((tensor.shape[0], gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ1_S][1]), np.uint8)
        writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.IQ1_S)

    monkeypatch.setattr(convert_gguf, "_add_tensor", iq1_for_one)
    convert_gguf.convert_hf_to_gguf(path, tmp_path / "m.gguf", "f16")
    with pytest.raises(ModelFormatError, match=r"m.gguf: tensor 'blk.0.ffn_up.weight' has type IQ1_S, which draftflow "
                       r"does not read; expected one of F32, F16, BF16, Q8_0, Q4_0, .*, IQ4_XS; re-quantize") as exc:
        load_gguf(tmp_path / "m.gguf", "cpu", torch.float32)
    _single_line(exc)


def test_truncated_gguf(hf_dir, tmp_path):
    """A GGUF file cut inside its tensor data names the tensor that runs past the end."""
    _, path = hf_dir("qwen3")
    convert_gguf.convert_hf_to_gguf(path, tmp_path / "m.gguf", "q8_0")
    file = tmp_path / "m.gguf"
    os.truncate(file, file.stat().st_size - 64)
    with pytest.raises(ModelFormatError, match=r"m.gguf: tensor '[\w.]+' \(\w+, shape \[.*\]\) needs bytes \d+..\d+ but "
                       r"the file ends at byte \d+; the file is truncated or corrupt") as exc:
        load_gguf(file, "cpu", torch.float32)
    _single_line(exc)


def test_gguf_missing_tensor_uses_gguf_names(hf_dir, tmp_path, monkeypatch):
    """A GGUF file lacking a tensor names it by its llama.cpp name."""
    _, path = hf_dir("qwen2")
    original = convert_gguf._add_tensor
    monkeypatch.setattr(convert_gguf, "_add_tensor",
                        lambda w, name, t, d: None if name == "blk.1.attn_k.bias" else original(w, name, t, d))
    convert_gguf.convert_hf_to_gguf(path, tmp_path / "m.gguf", "f32")
    with pytest.raises(ModelFormatError, match=r"tensor 'blk.1.attn_k.bias' is missing \(expected shape \[32\]\)"):
        load_gguf(tmp_path / "m.gguf", "cpu", torch.float32)
