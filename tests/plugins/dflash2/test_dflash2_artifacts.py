"""DFlash2 artifacts: config rules, the 81-tensor set, codebook spellings, rejections, converter round trips."""

from __future__ import annotations

import pytest
import torch
from dflash2_testlib import bare_codebooks, build_reference2, edit_config, save_reference
from gguf import GGUFReader
from safetensors.torch import load_file, save_file

from draftflow.core.errors import ModelFormatError
from draftflow.plugins.dflash.loader import load_drafter as load_dflash
from draftflow.plugins.dflash.dflash2_config import DFlash2Config, expected_tensors
from draftflow.plugins.dflash.dflash2_loader import load_drafter, read_artifact, read_config
from draftflow.tools.convert_dflash import gguf_to_hf, hf_to_gguf, main


@pytest.fixture
def drafter(tmp_path):
    """Factory: a saved random DFlash2 reference directory."""

    def make(name: str = "d2", dtype: torch.dtype = torch.float32, **extra):
        return save_reference(build_reference2(**extra), tmp_path / name, dtype)

    return make


def test_five_layer_drafter_has_81_tensors():
    """Qwen3.8-27B-DFlash2 shapes: 58 backbone + 20 conv + 3 selector tensors, kernel_projection [1280, 5120]."""
    d = {"architectures": ["DFlash2DraftModel"], "hidden_size": 5120, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 5, "intermediate_size": 17408,
         "vocab_size": 248320, "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61],
                                                 "block_size": 8, "conv_kernel_size": 2, "conv_group_size": 16,
                                                 "selector_rank": 256, "selector_top_k": 16}}
    shapes = expected_tensors(DFlash2Config.from_hf_dict(d, "cfg"))
    assert len(shapes) == 81
    assert shapes["layers.4.attention_conv.kernel_projection.weight"] == (1280, 5120)
    assert shapes["layers.0.mlp_conv.base_kernel"] == (2, 2, 5120)
    assert shapes["candidate_selector.successor_codebook.weight"] == (248320, 256)
    assert shapes["candidate_selector.hidden_projection.weight"] == (256, 5120)


def test_codebooks_load_with_or_without_weight_suffix(drafter, tmp_path):
    """The published spelling (no `.weight`) and the suffixed one load to the same weights."""
    a = drafter("a")
    b = save_reference(build_reference2(), tmp_path / "b")
    bare_codebooks(b)
    ma, _ = load_drafter(a, "cpu", torch.float32)
    mb, cfg = load_drafter(b, "cpu", torch.float32)
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (2, 16, 16, 8)
    for name, t in mb.state_dict().items():
        assert torch.equal(t, ma.state_dict()[name]), name


def test_both_codebook_spellings_are_an_error(drafter):
    """One tensor spelled both ways is refused by name."""
    path = drafter()
    tensors = load_file(path / "model.safetensors")
    tensors["candidate_selector.successor_codebook"] = tensors["candidate_selector.successor_codebook.weight"].clone()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelFormatError, match="both name 'candidate_selector.successor_codebook.weight'"):
        read_artifact(path)


@pytest.mark.parametrize("changes, message", [
    ({"architectures": ["DFlashDraftModel"]}, r"architectures is \['DFlashDraftModel'\]; expected \['DFlash2DraftModel'\]"),
    ({"dflash_selector_rank": None}, "selector_rank is None; expected an integer; set dflash_config.selector_rank"),
    ({"dflash_conv_group_size": 24}, "conv_group_size=24 does not divide hidden_size=64"),
    ({"dflash_conv_kernel_size": 7}, r"conv_kernel_size=7; expected 1..block_size \(6\)"),
    ({"dflash_selector_top_k": 400}, r"selector_top_k=400; expected 1..vocab_size \(320\)"),
])
def test_config_rejections(drafter, changes, message):
    """Wrong architecture, missing or inconsistent DFlash2 keys are refused with the key to fix."""
    path = drafter()
    edit_config(path, **changes)
    with pytest.raises(ModelFormatError, match=message):
        read_config(path)


def test_misshaped_and_foreign_tensors_are_reported(drafter):
    """A mis-shaped conv tensor names the expected shape; an embedding inside the artifact is refused."""
    path = drafter()
    tensors = load_file(path / "model.safetensors")
    tensors["layers.1.mlp_conv.base_kernel"] = torch.zeros(2, 3, 64)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelFormatError, match=r"against a 2-layer, 2-tap DFlash2 config \(36 tensors expected\): tensor "
                                               r"'layers.1.mlp_conv.base_kernel' has shape \[2, 3, 64\], expected \[2, 2, 64\]"):
        read_artifact(path)
    tensors["layers.1.mlp_conv.base_kernel"] = torch.zeros(2, 2, 64)
    tensors["lm_head.weight"] = torch.zeros(4, 4)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelFormatError, match="embedding or LM head inside the artifact"):
        read_artifact(path)


def test_plugin_dflash_still_rejects_dflash2_artifacts(drafter, tmp_path):
    """`plugin: dflash` on a DFlash2 directory or GGUF points to the dflash2 plugin."""
    path = drafter()
    with pytest.raises(ModelFormatError, match="DFlash2 convolution/selector tensor.*use the dflash2 plugin"):
        load_dflash(path, "cpu", torch.float32)
    hf_to_gguf(path, tmp_path / "d2.gguf")
    with pytest.raises(ModelFormatError, match="DFlash2 convolution/selector tensor.*use the dflash2 plugin"):
        load_dflash(tmp_path / "d2.gguf", "cpu", torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(drafter, tmp_path, dtype):
    """HF -> GGUF -> HF -> GGUF keeps every tensor's bits and dtype and the whole config."""
    path = drafter(dtype=dtype)
    bare_codebooks(path)
    hf_to_gguf(path, tmp_path / "a.gguf")
    gguf_to_hf(tmp_path / "a.gguf", tmp_path / "back")
    hf_to_gguf(tmp_path / "back", tmp_path / "b.gguf")
    src, back = read_artifact(path), read_artifact(tmp_path / "back")
    assert back.config == src.config and src.tensors.keys() == back.tensors.keys()
    for name, t in src.tensors.items():
        assert t.dtype == dtype == back.tensors[name].dtype, name
        assert torch.equal(t.view(torch.uint8), back.tensors[name].view(torch.uint8)), name
    assert "candidate_selector.predecessor_codebook" in load_file(tmp_path / "back" / "model.safetensors")
    a, b = GGUFReader(tmp_path / "a.gguf"), GGUFReader(tmp_path / "b.gguf")
    assert [(t.name, t.data.tobytes()) for t in a.tensors] == [(t.name, t.data.tobytes()) for t in b.tensors]


def test_gguf_uses_llama_cpp_names_and_keys(drafter, tmp_path):
    """GGUF: attn_conv_base/proj, ffn_conv_*, selector_* tensors and dflash.conv_*/selector_* keys; loads identically."""
    path = drafter()
    assert main([str(path), str(tmp_path / "l.gguf")]) == 0
    reader = GGUFReader(tmp_path / "l.gguf")
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_conv_base", "blk.1.attn_conv_proj.weight", "blk.0.ffn_conv_base", "blk.1.ffn_conv_proj.weight",
            "selector_predecessor.weight", "selector_successor.weight", "selector_hidden.weight"} <= names
    assert len(names) == 36
    keys = {k: reader.get_field(f"dflash.{k}").contents() for k in
            ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    assert keys == {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}
    base = next(t for t in reader.tensors if t.name == "blk.0.attn_conv_base")
    assert list(base.shape) == [64, 2, 2]  # ne order {H, K, 2}
    hf_model, hf_cfg = load_drafter(path, "cpu", torch.float32)
    gg_model, gg_cfg = load_drafter(tmp_path / "l.gguf", "cpu", torch.float32)
    assert gg_cfg == hf_cfg
    for name, t in gg_model.state_dict().items():
        assert torch.equal(t, hf_model.state_dict()[name]), name


def test_raw_hf_names_in_gguf_load_identically(drafter, tmp_path):
    """A DFlash2 GGUF that keeps Hugging Face tensor names is recognised and loads to the same weights."""
    path = drafter()
    assert main([str(path), str(tmp_path / "h.gguf"), "--names", "hf"]) == 0
    hf_model, _ = load_drafter(path, "cpu", torch.float32)
    gg_model, _ = load_drafter(tmp_path / "h.gguf", "cpu", torch.float32)
    for name, t in gg_model.state_dict().items():
        assert torch.equal(t, hf_model.state_dict()[name]), name
