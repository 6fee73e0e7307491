"""`draftflow train dflash --init-from DRAFTER --layers N` with N above the drafter's: it grows, drafting as before."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT

from draftflow.core.errors import DraftflowError
from draftflow.plugins.dflash.loader import read_artifact
from draftflow.plugins.dflash.model import DFlashModel
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.tools.tiny_model import write_tiny_model
from draftflow.tools.train.cli import main as train_main
from draftflow.tools.train.dflash_recipe import DFlashRecipe, grown_config, zero_new_layers
from draftflow.tools.train.dflash2_recipe import load_backbone
from draftflow.tools.train.loop import init_weights

SMALL = ["--seq-len", "64", "--batch-size", "4", "--eval-windows", "2", "--eval-every", "0", "--save-every", "0",
         "--max-data-mb", "0.2", "--lr", "3e-3", "--warmup", "0.1", "--device", "cpu"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target and a 1-layer DFlash drafter trained 20 steps for it."""
    root = tmp_path_factory.mktemp("grow")
    target = write_tiny_model(root / "target", vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64,
                              context=256)
    assert train_main(["dflash", "--target", str(target), "--out", str(root / "d1"), "--data", str(ROOT / "core"),
                       "--steps", "20", "--mask-token-id", "255", "--block-size", "4", "--anchors", "8", "--layers",
                       "1", "--tap-layers", "0,1", *SMALL]) == 0
    return target, root / "d1"


def test_a_grown_drafter_drafts_exactly_as_the_one_it_grew_from(trained):
    """Two layers grown from the trained one: the same block logits, bit for bit, before any training step; the new
    layer's other weights are random (so training can move it)."""
    target, small = trained
    model = load_hf(target, "cpu", torch.float32).model
    art = read_artifact(small)
    one = DFlashModel(art.config)
    one.load_state_dict(art.tensors)
    cfg = grown_config(art.config, 2)
    two = DFlashModel(cfg)
    init_weights(two, seed=3)
    load_backbone(two, str(small), grown_from=1)
    zero_new_layers(two, 1)
    assert two.layers[1].self_attn.q_proj.weight.abs().sum() > 0
    tokens = torch.randint(0, 255, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = DFlashRecipe(model, two, num_anchors=40).forward_blocks(tokens).logits
        want = DFlashRecipe(model, one, num_anchors=40).forward_blocks(tokens).logits
    assert torch.equal(got, want)


def test_cli_grows_trains_and_writes_the_deeper_drafter(trained, tmp_path):
    target, small = trained
    out, summary = tmp_path / "d2", tmp_path / "d2.json"
    assert train_main(["dflash", "--target", str(target), "--init-from", str(small), "--layers", "2", "--out", str(out),
                       "--data", str(ROOT / "core"), "--steps", "10", "--summary", str(summary), *SMALL]) == 0
    art = read_artifact(out)
    assert art.config.num_layers == 2 and art.config.block_size == 4
    assert art.tensors["layers.1.self_attn.o_proj.weight"].abs().sum() > 0  # trained away from zero
    s = json.loads(summary.read_text())
    assert s["steps"] == 10 and s["parameters"] > 0


def test_fewer_layers_than_the_init_drafter_is_one_error(trained, tmp_path):
    target, small = trained
    deeper = tmp_path / "d2"
    assert train_main(["dflash", "--target", str(target), "--init-from", str(small), "--layers", "2", "--out",
                       str(deeper), "--data", str(ROOT / "core"), "--steps", "2", *SMALL]) == 0
    with pytest.raises(DraftflowError, match="--layers 1 \\(it has 2\\)"):
        train_main(["dflash", "--target", str(target), "--init-from", str(deeper), "--layers", "1", "--out",
                    str(tmp_path / "x"), "--data", str(ROOT / "core"), "--steps", "1", *SMALL])
