"""`draftflow train dflash2`: smoke run lowers both losses, resume, init from DFlash or DFlash2, outputs pass the greedy gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import ROOT

from draftflow.core.errors import DraftflowError
from draftflow.plugins.dflash.dflash2_config import DFlash2Config
from draftflow.plugins.dflash.dflash2_loader import read_artifact
from draftflow.plugins.dflash.loader import load_drafter as load_dflash
from draftflow.plugins.dflash.model import DFlashModel
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.layers.kv_cache import KVCache
from draftflow.testing import greedy_gate
from draftflow.tools.tiny_model import write_tiny_model
from draftflow.tools.train.cli import main as train_main
from draftflow.tools.train.dflash2_recipe import DFlash2Recipe, init_backbone_config, new_drafter
from draftflow.tools.train.dflash_recipe import DFlashRecipe, block_hidden, new_config
from draftflow.tools.train.loop import WindowKV, init_weights

SMALL = ["--seq-len", "64", "--batch-size", "4", "--eval-windows", "2", "--eval-every", "0", "--save-every", "0",
         "--max-data-mb", "0.2", "--lr", "3e-3", "--warmup", "0.1", "--device", "cpu"]
SHAPE = ["--mask-token-id", "255", "--block-size", "4", "--anchors", "8", "--layers", "1", "--tap-layers", "0,1"]
SELECTOR = ["--conv-group-size", "8", "--selector-rank", "16", "--selector-top-k", "4", "--selector-warmup", "0",
            "--selector-ramp", "0"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random 2-layer Qwen3 target (hidden 32, vocab 256) with a BPE tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("train2") / "target", vocab=256, hidden=32, layers=2, heads=4,
                            kv_heads=2, intermediate=64, context=256)


def _train(target: Path, out: Path, steps: int, *extra: str, kind: str = "dflash2") -> dict:
    summary = out.parent / f"{out.name}.json"
    args = [kind, "--target", str(target), "--out", str(out), "--data", str(ROOT / "core"), "--steps", str(steps),
            "--summary", str(summary), *SMALL, *extra]
    assert train_main(args) == 0
    return json.loads(summary.read_text())


@pytest.fixture(scope="module")
def run(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("dflash2") / "drafter"
    return out, _train(target, out, 40, *SHAPE, *SELECTOR, "--gguf", str(out.parent / "drafter.gguf"))


def _graph(target: Path, drafter: Path, selector: str, tmp_path: Path) -> Path:
    spec = {"name": selector, "device": "cpu", "dtype": "float32", "num_draft": 3, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(target), "kv_mode": "static", "tap_layers": [0, 1]}},
        "drafter": {"plugin": "dflash2", "params": {"path": str(drafter)}},
        "selector": {"plugin": selector}, "verify": {"plugin": "verifier"}}}
    path = tmp_path / f"{selector}-{drafter.name}.yaml"
    path.write_text(json.dumps(spec))
    return path


def test_dflash2_smoke_run_lowers_token_and_selector_loss(run):
    """40 CPU steps lower the decayed token loss and the selector's cross-entropy; the estimate has both selectors."""
    _, s = run
    first, last = s["first_parts"], s["last_parts"]
    assert s["steps"] == 40 and s["last_loss"] < s["first_loss"] - 0.3, s
    assert last["token_loss"] < first["token_loss"] - 0.3, s
    assert last["selector_loss"] < first["selector_loss"] - 0.1, s
    final = s["evaluations"][-1][1]
    assert {"loss", "token_loss", "selector_loss", "recall", "tau", "tau_top1"} <= set(final)
    assert 1.0 <= final["tau"] <= 4.0 and 1.0 <= final["tau_top1"] <= 4.0


def test_dflash2_outputs_load_and_pass_the_greedy_gate(target, run, tmp_path):
    """The HF directory and its GGUF load in the dflash2 node; both selectors stay lossless."""
    out, _ = run
    art = read_artifact(out)
    assert isinstance(art.config, DFlash2Config) and art.config.selector_top_k == 4
    assert read_artifact(out.parent / "drafter.gguf").config == art.config
    # The successor codebook left zero would make the learned selector the top-1 one: it must have trained.
    assert art.tensors["candidate_selector.successor_codebook.weight"].abs().max() > 0
    for drafter in (out, out.parent / "drafter.gguf"):
        for selector in ("dflash2-selector", "top1-selector"):
            report = greedy_gate(_graph(target, drafter, selector, tmp_path), prompts=[[5, 6, 7, 8]], max_new_tokens=12)
            assert report.drafted > 0, (drafter, selector)


def test_dflash2_resume_continues_the_step_count(target, tmp_path):
    """A DFlash2 run resumed from its checkpoint starts at the saved step and keeps its loss parts."""
    out, ckpt = tmp_path / "d2", tmp_path / "state.pt"
    first = _train(target, out, 3, *SHAPE, *SELECTOR, "--checkpoint", str(ckpt))
    assert first["steps"] == 3 and ckpt.exists()
    saved = torch.load(ckpt, weights_only=False)["parts"]
    second = _train(target, out, 5, *SHAPE, *SELECTOR, "--checkpoint", str(ckpt), "--resume")
    assert second["resumed_from"] == 3 and second["steps"] == 5
    assert [s for s, _ in second["evaluations"]] == [3, 5]
    parts = torch.load(ckpt, weights_only=False)["parts"]
    assert [s for s, _ in parts] == [1, 2, 3, 4, 5] and parts[:3] == saved


def _dflash_drafter(target: Path, out: Path) -> Path:
    model = load_hf(target, "cpu", torch.float32).model
    drafter = DFlashModel(new_config(model, num_layers=1, block_size=4, tap_layers=(0, 1), mask_token_id=255))
    init_weights(drafter, std=0.2, seed=5)
    DFlashRecipe(model, drafter).save(out)
    return out


def test_init_from_dflash_starts_as_that_drafter(target, tmp_path):
    """From a DFlash drafter, identity convolutions and a zero successor codebook give its hidden states and drafts."""
    model = load_hf(target, "cpu", torch.float32).model
    v1 = _dflash_drafter(target, tmp_path / "v1")
    cfg = DFlash2Config(init_backbone_config(str(v1), model), 2, 8, 16, 4)
    # Frozen like the loaded drafter, so both take the same CPU product (layers/cpu_linear.py packs only inference
    # weights; a trainable one goes to F.linear, whose bits differ)
    two = DFlash2Recipe(model, new_drafter(cfg, seed=1, init_from=str(v1)).requires_grad_(False))
    one = DFlashRecipe(model, load_dflash(v1, "cpu", torch.float32)[0])
    tokens = torch.randint(0, 255, (1, 24), generator=torch.Generator().manual_seed(0))
    _, feats = model(tokens, 0, WindowKV(), logit_rows=0, tap_layers=(0, 1))
    with torch.no_grad():
        h2, _ = two.draft_rows(tokens[:, :12], feats[:, :12], 3)
        h1, l1 = one.draft_rows(tokens[:, :12], feats[:, :12], 3)
        drafts = two.propose(tokens[:, :12], feats[:, :12], 3)
    torch.testing.assert_close(h2, h1, rtol=0, atol=0)
    assert torch.equal(drafts[""], l1.argmax(-1)[0]) and torch.equal(drafts["top1"], drafts[""])


def test_init_from_refuses_a_disagreeing_shape_flag(target, tmp_path):
    """--init-from fixes the backbone's shape; a different --layers is named in the error."""
    v1 = _dflash_drafter(target, tmp_path / "v1")
    with pytest.raises(DraftflowError, match=r"--layers 2 \(it has 1\)"):
        train_main(["dflash2", "--target", str(target), "--out", str(tmp_path / "x"), "--data", str(ROOT / "core"),
                    "--steps", "1", "--init-from", str(v1), "--layers", "2", *SMALL])


def test_training_forward_matches_the_dflash2_node_for_one_anchor(target):
    """With non-identity convolutions, the multi-anchor training forward equals the inference block forward."""
    model = load_hf(target, "cpu", torch.float32).model
    base = new_config(model, num_layers=2, block_size=4, tap_layers=(0, 1), mask_token_id=255)
    drafter = new_drafter(DFlash2Config(base, 3, 8, 16, 4), seed=2)
    init_weights(drafter, std=0.2, seed=3)  # random convolutions: the per-block windows matter
    tokens = torch.randint(0, 255, (1, 24), generator=torch.Generator().manual_seed(0))
    _, feats = model(tokens, 0, WindowKV(), logit_rows=0, tap_layers=(0, 1))
    anchors = torch.tensor([[6, 11]])
    block = torch.full((1, 2, 4), 255)
    block[0, :, 0] = tokens[0, anchors[0]]
    x = torch.nn.functional.embedding(block.flatten(1), model.embed_tokens.weight)
    with torch.no_grad():
        trained = block_hidden(drafter, feats, x, anchors).view(1, 2, 4, -1)
        for b, anchor in enumerate(anchors[0].tolist()):
            cache = KVCache.from_static(torch.zeros(2, 2, 1, 32, base.num_kv_heads, base.head_dim))
            served = drafter.draft(feats[:, :anchor], 0, x[:, 4 * b:4 * b + 4], cache)
            torch.testing.assert_close(trained[:, b], served, rtol=1e-5, atol=1e-5)


def test_selector_loss_injects_the_gold_token_outside_the_top_m(target):
    """A label outside a row's top-M replaces its weakest candidate; recall counts the rows that needed none."""
    model = load_hf(target, "cpu", torch.float32).model
    base = new_config(model, num_layers=1, block_size=4, tap_layers=(0, 1), mask_token_id=255)
    recipe = DFlash2Recipe(model, new_drafter(DFlash2Config(base, 2, 8, 16, 2), seed=0))
    tokens = torch.randint(0, 255, (2, 32), generator=torch.Generator().manual_seed(1))
    blocks = recipe.forward_blocks(tokens)
    labels = blocks.logits.topk(2, dim=-1).indices[:, 0].view_as(blocks.labels)  # every label is its row's best
    _, recall = recipe.selector_loss(blocks._replace(labels=labels))
    assert float(recall) == 1.0
    worst = blocks.logits.argmin(-1).view_as(blocks.labels)  # never inside a top-2
    loss, recall = recipe.selector_loss(blocks._replace(labels=worst))
    assert float(recall) == 0.0 and torch.isfinite(loss)


def test_dflash2_init_from_a_dflash2_continues_all_of_it(target, run, tmp_path):
    """`train dflash2 --init-from` a DFlash2 drafter starts from every tensor it has (convolutions and selector
    too; a 1e-12 learning rate leaves them as they were) and keeps its whole shape."""
    trained, _ = run
    out = tmp_path / "continued"
    _train(target, out, 1, "--init-from", str(trained), "--lr", "1e-12")
    before, after = read_artifact(trained), read_artifact(out)
    assert after.config == before.config
    assert set(after.tensors) == set(before.tensors)
    assert any(float(t.abs().max()) > 0 for n, t in before.tensors.items() if "successor_codebook" in n)
    for name, t in before.tensors.items():
        torch.testing.assert_close(after.tensors[name], t, rtol=0, atol=1e-6, msg=name)


def test_dflash_init_from_continues_that_drafter(target, tmp_path):
    """`train dflash --init-from` starts from the given drafter's tensors (a 1e-12 learning rate leaves them as
    they were) and keeps its shape; a disagreeing shape flag is named."""
    v1 = _dflash_drafter(target, tmp_path / "v1")
    out = tmp_path / "continued"
    _train(target, out, 1, "--init-from", str(v1), "--lr", "1e-12", kind="dflash")
    from draftflow.plugins.dflash.loader import read_artifact as read_v1

    before, after = read_v1(v1), read_v1(out)
    assert after.config.target_layer_ids == before.config.target_layer_ids and after.config.block_size == 4
    assert set(after.tensors) == set(before.tensors)
    for name, t in before.tensors.items():
        torch.testing.assert_close(after.tensors[name], t, rtol=0, atol=1e-6, msg=name)
    with pytest.raises(DraftflowError, match=r"--block-size 8 \(it has 4\)"):
        train_main(["dflash", "--target", str(target), "--out", str(tmp_path / "x"), "--data", str(ROOT / "core"),
                    "--steps", "1", "--init-from", str(v1), "--block-size", "8", *SMALL])
