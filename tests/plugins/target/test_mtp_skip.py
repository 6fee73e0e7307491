"""A target checkpoint that carries MTP heads loads as a target; undeclared extras stay errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftflow.core.errors import ModelFormatError
from draftflow.plugins.target.hf_loader import load_hf


def add_tensor(path, name, config_extra):
    weights = load_file(str(path / "model.safetensors"))
    weights[name] = torch.zeros(64, 128)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(config_extra)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("name, extra", [("model.layers.2.eh_proj.weight", {"num_nextn_predict_layers": 1}),
                                         ("mtp.fc.weight", {"mtp_num_hidden_layers": 1})])
def test_declared_mtp_tensors_are_skipped(hf_dir, name, extra):
    """Tensors of MTP heads declared in config.json are left for the mtp node, not rejected."""
    _, path = hf_dir("qwen3")
    add_tensor(path, name, extra)
    loaded = load_hf(path, "cpu", torch.float32)
    assert loaded.config.num_layers == 2


def test_undeclared_extra_layer_is_still_an_error(hf_dir):
    """Without an MTP declaration an extra layer means config and weights disagree."""
    _, path = hf_dir("qwen3")
    add_tensor(path, "model.layers.2.eh_proj.weight", {})
    with pytest.raises(ModelFormatError, match="'model.layers.2.eh_proj.weight' is not part of a qwen3 model"):
        load_hf(path, "cpu", torch.float32)
