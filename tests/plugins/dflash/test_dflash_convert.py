"""The HF <-> GGUF converter: bit-exact round trips and llama.cpp naming."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader

from draftflow.plugins.dflash.loader import load_drafter, read_artifact
from draftflow.tools.convert_dflash import gguf_to_hf, hf_to_gguf, main


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_bit_exact(drafter_dir, tmp_path, dtype):
    """HF -> GGUF -> HF -> GGUF keeps every tensor's bits and dtype and the whole config."""
    _, path = drafter_dir(dtype=dtype)
    hf_to_gguf(path, tmp_path / "a.gguf")
    gguf_to_hf(tmp_path / "a.gguf", tmp_path / "back")
    hf_to_gguf(tmp_path / "back", tmp_path / "b.gguf")
    src, back = read_artifact(path), read_artifact(tmp_path / "back")
    assert back.config == src.config
    assert src.tensors.keys() == back.tensors.keys()
    for name, t in src.tensors.items():
        assert t.dtype == dtype == back.tensors[name].dtype, name
        assert torch.equal(t.view(torch.uint8), back.tensors[name].view(torch.uint8)), name
    a, b = GGUFReader(tmp_path / "a.gguf"), GGUFReader(tmp_path / "b.gguf")
    assert [(t.name, t.data.tobytes()) for t in a.tensors] == [(t.name, t.data.tobytes()) for t in b.tensors]


def test_llama_cpp_names_and_keys_load_like_the_hf_directory(drafter_dir, tmp_path):
    """A GGUF with llama.cpp names and target_layers = ids + 1 loads to the same weights and config."""
    _, path = drafter_dir(dtype=torch.bfloat16)
    hf_to_gguf(path, tmp_path / "l.gguf")
    reader = GGUFReader(tmp_path / "l.gguf")
    names = {t.name for t in reader.tensors}
    assert {"fc.weight", "enc.output_norm.weight", "output_norm.weight", "blk.1.attn_q.weight", "blk.0.ffn_down.weight"} <= names
    assert len(names) == 25
    assert list(reader.get_field("dflash.target_layers").contents()) == [2, 3]
    assert reader.get_field("tokenizer.ggml.mask_token_id").contents() == 300
    hf_model, hf_cfg = load_drafter(path, "cpu", torch.float32)
    gg_model, gg_cfg = load_drafter(tmp_path / "l.gguf", "cpu", torch.float32)
    assert gg_cfg == hf_cfg and gg_cfg.target_layer_ids == (1, 2)
    want = hf_model.state_dict()
    for name, t in gg_model.state_dict().items():
        assert torch.equal(t, want[name]), name


def test_raw_hf_names_in_gguf_load_identically(drafter_dir, tmp_path):
    """A GGUF that keeps Hugging Face tensor names loads to the same weights."""
    _, path = drafter_dir()
    assert main([str(path), str(tmp_path / "h.gguf"), "--names", "hf"]) == 0
    assert "layers.0.self_attn.q_proj.weight" in {t.name for t in GGUFReader(tmp_path / "h.gguf").tensors}
    hf_model, _ = load_drafter(path, "cpu", torch.float32)
    gg_model, _ = load_drafter(tmp_path / "h.gguf", "cpu", torch.float32)
    for name, t in gg_model.state_dict().items():
        assert torch.equal(t, hf_model.state_dict()[name]), name


def test_cli_reports_bad_source_in_one_line(tmp_path, capsys):
    """The converter CLI exits 1 with `error: ...` for a missing source."""
    assert main([str(tmp_path / "nope"), str(tmp_path / "x.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no such DFlash directory or file" in err
