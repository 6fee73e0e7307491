"""`--distill W`: each block row's loss blends cross-entropy with the KL to the target's own distribution."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT

from draftflow.core.errors import DraftflowError
from draftflow.plugins.dflash.model import DFlashModel
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.tools.tiny_model import write_tiny_model
from draftflow.tools.train.cli import main as train_main
from draftflow.tools.train.dflash_recipe import DFlashRecipe, new_config
from draftflow.tools.train.loop import WindowKV, init_weights

SMALL = ["--seq-len", "64", "--batch-size", "4", "--eval-windows", "2", "--eval-every", "0", "--save-every", "0",
         "--max-data-mb", "0.2", "--lr", "3e-3", "--warmup", "0.1", "--device", "cpu", "--mask-token-id", "255",
         "--block-size", "4", "--anchors", "8", "--layers", "1", "--tap-layers", "0,1"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("distill") / "target", vocab=256, hidden=32, layers=2, heads=4,
                            kv_heads=2, intermediate=64, context=256)


def _pair(target):
    """The tiny target and a random 1-layer DFlash drafter (block 4) for it."""
    model = load_hf(target, "cpu", torch.float32).model
    drafter = DFlashModel(new_config(model, num_layers=1, block_size=4, tap_layers=(0, 1), mask_token_id=255))
    init_weights(drafter, std=0.2, seed=5)
    return model, drafter


@pytest.mark.parametrize("labels", ["data", "target"])
def test_row_loss_is_ce_and_kl_to_the_target_at_the_label_position(target, labels):
    """Every row's teacher is the target's softmax at the position before its label, and the loss is the decayed mean
    of (1 - w) CE + w KL, recomputed here from one plain target forward."""
    model, drafter = _pair(target)
    seq, width, w = 24, 4, 0.3
    recipe = DFlashRecipe(model, drafter, num_anchors=seq, labels=labels, distill=w)  # every anchor 1 .. S-W
    tokens = torch.randint(0, 255, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        blocks = recipe.forward_blocks(tokens)
        loss = recipe.token_loss(blocks)
        full, _ = model(tokens, 0, WindowKV(), logit_rows=None)  # [2, S, V]
    anchors = torch.arange(1, seq - width + 1)  # what num_anchors >= the span picks
    at = anchors[:, None] + torch.arange(1, width)  # [N, W-1] label positions
    p_log = F.log_softmax(full[:, at - 1].float(), dim=-1)  # [2, N, W-1, V]
    torch.testing.assert_close(blocks.teacher.view_as(p_log), p_log.exp(), rtol=1e-5, atol=1e-6)
    if labels == "target":  # the greedy label is the teacher's argmax at the same row: the rows line up
        assert torch.equal(blocks.labels, p_log.argmax(-1))
    else:
        assert torch.equal(blocks.labels, tokens[:, at])
    log_q = F.log_softmax(blocks.logits.view(*p_log.shape), dim=-1)
    kl = F.kl_div(log_q, p_log, log_target=True, reduction="none").sum(-1)  # [2, N, W-1]
    ce = -log_q.gather(-1, blocks.labels[..., None])[..., 0]
    weight = torch.exp(-(torch.arange(1, width, dtype=torch.float32) - 1) / recipe.gamma).expand_as(kl)
    expected = (((1 - w) * ce + w * kl) * weight).sum() / weight.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert float(recipe.loss_parts["kl"]) > 0
    torch.testing.assert_close(recipe.loss_parts["kl"], (kl * weight).sum() / weight.sum(), rtol=1e-5, atol=1e-6)


def test_distill_zero_is_the_plain_cross_entropy(target):
    """w = 0 computes no teacher and gives the labels-only loss."""
    model, drafter = _pair(target)
    tokens = torch.randint(0, 255, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = DFlashRecipe(model, drafter, num_anchors=24, labels="data")
        blocks = plain.forward_blocks(tokens)
        zero = DFlashRecipe(model, drafter, num_anchors=24, labels="data", distill=0.0)
        assert blocks.teacher is None and zero.forward_blocks(tokens).teacher is None
        ce = F.cross_entropy(blocks.logits, blocks.labels.flatten(), reduction="none").view_as(blocks.labels)
        torch.testing.assert_close(plain.token_loss(blocks), plain.decayed_mean(ce))
        assert plain.loss_parts == {}


@pytest.mark.parametrize("recipe", ["dflash", "dflash2"])
def test_cli_run_with_distill_records_ce_and_kl(target, tmp_path, recipe):
    """`draftflow train dflash|dflash2 --distill 0.5` trains, lowers the loss and logs the KL part."""
    out, summary = tmp_path / "drafter", tmp_path / "run.json"
    extra = ["--selector-rank", "8", "--selector-top-k", "4", "--conv-group-size", "8"] if recipe == "dflash2" else []
    assert train_main([recipe, "--target", str(target), "--out", str(out), "--data", str(ROOT / "core"), "--steps",
                       "30", "--summary", str(summary), "--distill", "0.5", *SMALL, *extra]) == 0
    s = json.loads(summary.read_text())
    assert s["last_loss"] < s["first_loss"], s
    assert {"ce", "kl"} <= set(s["first_parts"]) and s["last_parts"]["kl"] < s["first_parts"]["kl"], s
    assert (out / "model.safetensors").exists()


@pytest.mark.parametrize("argv, message", [
    (["dflash", "--distill", "1.5"], "--distill 1.5: must be at most 1.0"),
    (["dflash", "--distill", "-0.1"], "--distill -0.1: must be at least 0.0"),
    (["mtp", "--distill", "0.5"], "--distill"),
])
def test_bad_distill_is_one_error_before_training(target, tmp_path, argv, message):
    args = [*argv, "--target", str(target), "--out", str(tmp_path / "x"), "--data", str(ROOT / "core"), "--steps", "1",
            *(SMALL if argv[0] != "mtp" else SMALL[:16])]
    with pytest.raises(DraftflowError, match=message.replace(".", r"\.")):
        train_main(args)
    assert not (tmp_path / "x").exists()


def test_distill_weight_outside_zero_one_is_refused_by_the_recipe(target):
    model, drafter = _pair(target)
    with pytest.raises(ValueError, match="distill 2"):
        DFlashRecipe(model, drafter, distill=2.0)


def test_help_documents_distill():
    from draftflow.tools.train.cli import build_parser

    text = build_parser().format_help()
    assert "--distill W" in text and "KL" in text

