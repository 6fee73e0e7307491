"""Loading DFlash artifacts: config rules, tensor-set validation and every rejection, matched by message."""

from __future__ import annotations

import pytest
import torch
from dflash_testlib import edit_config
from safetensors.torch import load_file, save_file

from draftflow.core.errors import ModelFormatError
from draftflow.plugins.dflash.config import DFlashConfig, default_target_layer_ids, expected_tensors
from draftflow.plugins.dflash.loader import load_drafter, read_config
from draftflow.tools.convert_dflash import hf_to_gguf


def rewrite(path, add=None, drop=(), replace=None):
    """Edit the tensors of a saved drafter directory in place."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name in drop:
        tensors.pop(name)
    tensors.update(add or {})
    tensors.update(replace or {})
    save_file(tensors, file)


def gguf_with(path, tmp_path, name=None, shape=(4, 4), replace=None):
    """A llama.cpp-named GGUF of the drafter plus one more tensor `name`, with HF-named tensors replaced."""
    import gguf

    from draftflow.plugins.dflash.loader import hf_to_gguf_name, read_artifact
    from draftflow.tools.convert_dflash import write_metadata

    art = read_artifact(path)
    out = tmp_path / "extra.gguf"
    writer = gguf.GGUFWriter(str(out), "dflash")
    write_metadata(writer, art.config, torch.float32)
    for hf, t in {**art.tensors, **(replace or {})}.items():
        writer.add_tensor(hf_to_gguf_name(hf), t.float().numpy())
    if name is not None:
        writer.add_tensor(name, torch.zeros(shape).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_reads_zlab_directory(drafter_dir):
    """A z-lab directory gives block size, tap ids, mask id and the 11-per-layer + 3 tensor set."""
    _, path = drafter_dir()
    cfg = read_config(path)
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id, cfg.num_taps) == (6, (1, 2), 300, 2)
    assert len(expected_tensors(cfg)) == 2 * 11 + 3
    model, _ = load_drafter(path, "cpu", torch.float32)
    assert model.fc.weight.shape == (64, 128)


def test_five_layer_drafter_has_58_tensors():
    """The Qwen3-8B drafter shape: 5 layers, 5 taps -> 58 tensors, fc [4096, 20480]."""
    d = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
         "num_hidden_layers": 5, "intermediate_size": 12288, "num_target_layers": 36,
         "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}}
    shapes = expected_tensors(DFlashConfig.from_hf_dict(d, "cfg"))
    assert len(shapes) == 58 and shapes["fc.weight"] == (4096, 20480)
    assert shapes["layers.4.self_attn.k_proj.weight"] == (1024, 4096)


def test_default_target_layer_rule(drafter_dir):
    """Absent ids follow z-lab's rule: [1, 9, 17, 25, 33] for 36 target / 5 draft layers, n//2 for one layer."""
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,)
    _, path = drafter_dir()
    edit_config(path, dflash_config={"mask_token_id": 300}, num_target_layers=36, num_hidden_layers=2)
    assert read_config(path).target_layer_ids == default_target_layer_ids(36, 2) == (1, 33)


def test_missing_ids_and_target_count_is_an_error(drafter_dir):
    """Without target_layer_ids and num_target_layers the tap layers are unknown."""
    _, path = drafter_dir()
    edit_config(path, dflash_config={"mask_token_id": 300}, num_target_layers=None)
    with pytest.raises(ModelFormatError, match="target_layer_ids is absent and num_target_layers is None"):
        read_config(path)


def test_missing_mask_id_is_an_error(drafter_dir):
    """A config without mask_token_id names the key to set."""
    _, path = drafter_dir()
    edit_config(path, dflash_config={"target_layer_ids": [1, 2]})
    with pytest.raises(ModelFormatError, match="mask_token_id is None; expected a token id; set dflash_config.mask_token_id"):
        read_config(path)


REJECTIONS = [
    ("layers.0.attention_conv.base_kernel", "is a DFlash2 convolution/selector tensor.*use the dflash2 plugin"),
    ("candidate_selector.hidden_projection.weight", "is a DFlash2 convolution/selector tensor.*use the dflash2 plugin"),
    ("markov_w1", "is a DSpark Markov/confidence tensor; DSpark drafters are not supported"),
    ("conf_proj.weight", "is a DSpark Markov/confidence tensor; DSpark drafters are not supported"),
    ("embed_tokens.weight", "is an embedding or LM head inside the artifact; DFlash binds both from the target"),
    ("lm_head.weight", "is an embedding or LM head inside the artifact; DFlash binds both from the target"),
    ("layers.0.self_attn.rotary.weight", "tensor 'layers.0.self_attn.rotary.weight' is not part of a DFlash drafter "
                                         r"\(unknown extra tensor\)"),
]


@pytest.mark.parametrize("name, message", REJECTIONS)
def test_hf_directory_rejections(drafter_dir, name, message):
    """Foreign or extra tensors in a HF directory are rejected, each with its own message."""
    _, path = drafter_dir()
    rewrite(path, add={name: torch.zeros(4, 4)})
    with pytest.raises(ModelFormatError, match=message):
        load_drafter(path, "cpu", torch.float32)


@pytest.mark.parametrize("name, message", [
    ("blk.0.attn_conv_base", "'blk.0.attn_conv_base' is a DFlash2 convolution/selector tensor"),
    ("selector_hidden.weight", "'selector_hidden.weight' is a DFlash2 convolution/selector tensor"),
    ("markov_w2", "'markov_w2' is a DSpark Markov/confidence tensor"),
    ("token_embd.weight", "'token_embd.weight' is an embedding or LM head inside the artifact"),
    ("output.weight", "'output.weight' is an embedding or LM head inside the artifact"),
    ("blk.0.attn_sinks.weight", "'blk.0.attn_sinks.weight' is not part of a DFlash drafter"),
])
def test_gguf_rejections_use_gguf_names(drafter_dir, tmp_path, name, message):
    """GGUF files get the same rejections, naming the tensor as the file spells it."""
    _, path = drafter_dir()
    with pytest.raises(ModelFormatError, match=message):
        load_drafter(gguf_with(path, tmp_path, name), "cpu", torch.float32)


def test_missing_tensor_is_listed_with_its_shape(drafter_dir):
    """A missing tensor is named with the shape the config expects."""
    _, path = drafter_dir()
    rewrite(path, drop=["layers.1.mlp.up_proj.weight"])
    with pytest.raises(ModelFormatError, match=r"tensor 'layers.1.mlp.up_proj.weight' is missing \(expected shape \[96, 64\]\)"):
        load_drafter(path, "cpu", torch.float32)


def test_misshaped_tensor_is_reported_against_metadata(drafter_dir):
    """fc.weight must be [H, n_taps*H]; a three-tap fc in a two-tap config is rejected."""
    _, path = drafter_dir()
    rewrite(path, replace={"fc.weight": torch.zeros(64, 192)})
    with pytest.raises(ModelFormatError, match=r"tensor 'fc.weight' has shape \[64, 192\], expected \[64, 128\]"):
        load_drafter(path, "cpu", torch.float32)


def test_misshaped_gguf_tensor_uses_llama_name(drafter_dir, tmp_path):
    """A mis-shaped GGUF tensor is named as llama.cpp spells it (enc.output_norm = hidden_norm)."""
    _, path = drafter_dir()
    bad = gguf_with(path, tmp_path, replace={"hidden_norm.weight": torch.ones(32)})
    with pytest.raises(ModelFormatError, match=r"tensor 'enc.output_norm.weight' has shape \[32\], expected \[64\]"):
        load_drafter(bad, "cpu", torch.float32)


def test_unsupported_dtype_is_rejected(drafter_dir):
    """Only BF16, F16 and F32 tensors are accepted."""
    _, path = drafter_dir()
    rewrite(path, replace={"norm.weight": torch.ones(64, dtype=torch.float64)})
    with pytest.raises(ModelFormatError, match="tensor 'norm.weight' has dtype F64; expected BF16, F16 or F32"):
        load_drafter(path, "cpu", torch.float32)


def test_gguf_of_another_architecture_is_rejected(tmp_path):
    """A GGUF whose general.architecture is not dflash is refused by name."""
    import gguf

    out = tmp_path / "qwen3.gguf"
    writer = gguf.GGUFWriter(str(out), "qwen3")
    writer.add_tensor("x", torch.zeros(2).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFormatError, match="general.architecture is 'qwen3'; expected 'dflash'"):
        read_config(out)


def test_gguf_conversion_refuses_invalid_source(drafter_dir, tmp_path):
    """The converter validates the source artifact first."""
    _, path = drafter_dir()
    rewrite(path, add={"lm_head.weight": torch.zeros(4, 4)})
    with pytest.raises(ModelFormatError, match="embedding or LM head"):
        hf_to_gguf(path, tmp_path / "x.gguf")
