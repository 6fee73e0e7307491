"""Drafter training: smoke runs lower the loss, resume continues, outputs load and pass the greedy gate."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
from helpers import ROOT

from draftflow.core.errors import DraftflowError
from draftflow.plugins.dflash.loader import read_artifact
from draftflow.plugins.dflash.model import DFlashModel
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.layers.kv_cache import KVCache
from draftflow.testing import greedy_gate
from draftflow.tools.tiny_model import write_tiny_model
from draftflow.tools.train.cli import main as train_main
from draftflow.tools.train.dflash_recipe import block_hidden, new_config
from draftflow.tools.train.loop import WindowKV, init_weights, lr_factor

SMALL = ["--seq-len", "64", "--batch-size", "4", "--eval-windows", "2", "--eval-every", "0", "--save-every", "0",
         "--max-data-mb", "0.2", "--lr", "3e-3", "--warmup", "0.1", "--device", "cpu"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random 2-layer Qwen3 target (hidden 32, vocab 256) with a BPE tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("train") / "target", vocab=256, hidden=32, layers=2, heads=4,
                            kv_heads=2, intermediate=64, context=256)


def _train(kind: str, target: Path, out: Path, steps: int, *extra: str) -> dict:
    summary = out.parent / f"{out.name}.json"
    args = [kind, "--target", str(target), "--out", str(out), "--data", str(ROOT / "core"), "--steps", str(steps),
            "--summary", str(summary), *SMALL, *extra]
    if kind == "dflash":
        args += ["--mask-token-id", "255", "--block-size", "4", "--anchors", "8", "--layers", "1", "--tap-layers", "0,1"]
    assert train_main(args) == 0
    return json.loads(summary.read_text())


@pytest.fixture(scope="module")
def dflash_run(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("dflash") / "drafter"
    return out, _train("dflash", target, out, 40, "--gguf", str(out.parent / "drafter.gguf"), "--eval-decode-tokens",
                       "10")


@pytest.fixture(scope="module")
def mtp_run(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp") / "head"
    return out, _train("mtp", target, out, 30)


def test_new_dflash_drafters_attend_their_training_window(dflash_run, target, tmp_path):
    """A fresh DFlash drafter's layers are non-causal sliding windows of --seq-len cells (what training shows it);
    --window 0 gives full attention, a window shorter than the block is refused in one line."""
    out, _ = dflash_run
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention"] and cfg["sliding_window"] == 64 and cfg["is_causal"] is False
    full = tmp_path / "full"
    _train("dflash", target, full, 1, "--window", "0")
    assert "layer_types" not in json.loads((full / "config.json").read_text())
    with pytest.raises(DraftflowError, match="--window 2 is shorter than the block of 4"):
        _train("dflash", target, tmp_path / "short", 1, "--window", "2")
    with pytest.raises(DraftflowError, match="--window -1: must be at least 0"):
        _train("dflash", target, tmp_path / "neg", 1, "--window", "-1")


def test_lr_warms_up_then_decays_to_zero():
    """The schedule rises linearly over the warm-up share, peaks at 1 and ends at 0."""
    assert lr_factor(0.0, 0.1) == 0.0 and lr_factor(0.05, 0.1) == pytest.approx(0.5)
    assert lr_factor(0.1, 0.1) == pytest.approx(1.0) and lr_factor(1.0, 0.1) == pytest.approx(0.0)


def test_dflash_smoke_run_lowers_the_loss(dflash_run):
    """A few DFlash steps on a tiny random target lower the position-decayed block loss."""
    _, s = dflash_run
    assert s["steps"] == 40 and s["last_loss"] < s["first_loss"] - 0.3, s
    final = s["evaluations"][-1][1]
    assert {"loss", "tau", "acceptance"} <= set(final) and 1.0 <= final["tau"] <= 4.0
    assert 1.0 <= final["tau_decode"] <= 4.0 and 0.0 <= final["acceptance_decode"] <= 1.0  # --eval-decode-tokens
    assert [step for step, _ in s["evaluations"]] == [40]  # the final evaluation, once


def test_mtp_smoke_run_lowers_the_loss(mtp_run):
    """A few MTP steps on a tiny random target lower the next-next-token loss."""
    _, s = mtp_run
    assert s["steps"] == 30 and s["last_loss"] < s["first_loss"] - 0.3, s


def test_resume_continues_the_step_count(target, tmp_path):
    """A run resumed from its checkpoint starts at the saved step and ends at --steps."""
    out, ckpt = tmp_path / "mtp", tmp_path / "state.pt"
    first = _train("mtp", target, out, 3, "--checkpoint", str(ckpt))
    assert first["steps"] == 3 and ckpt.exists()
    second = _train("mtp", target, out, 5, "--checkpoint", str(ckpt), "--resume")
    assert second["resumed_from"] == 3 and second["steps"] == 5
    assert [s for s, _ in second["evaluations"]] == [3, 5]


def test_trained_outputs_pass_the_greedy_gate(target, dflash_run, mtp_run, tmp_path):
    """The DFlash directory, its GGUF and the MTP directory load through their nodes and stay lossless."""
    dflash, _ = dflash_run
    mtp, _ = mtp_run
    assert read_artifact(dflash.parent / "drafter.gguf").config.target_layer_ids == (0, 1)
    import gguf

    fields = gguf.GGUFReader(dflash.parent / "drafter.gguf").fields  # llama.cpp needs the target's tokenizer keys
    assert {"tokenizer.ggml.model", "tokenizer.ggml.tokens"} <= set(fields)
    graphs = {
        "dflash.yaml": {"drafter": {"plugin": "dflash", "params": {"path": str(dflash)}}, "taps": [0, 1], "k": 3},
        "gguf.yaml": {"drafter": {"plugin": "dflash", "params": {"path": str(dflash.parent / "drafter.gguf")}},
                      "taps": [0, 1], "k": 3},
        "mtp.yaml": {"drafter": {"plugin": "mtp", "params": {"path": str(mtp)}}, "taps": [1], "k": 2},
    }
    for name, g in graphs.items():
        spec = {"name": name, "device": "cpu", "dtype": "float32", "num_draft": g["k"], "nodes": {
            "target": {"plugin": "target", "params": {"path": str(target), "kv_mode": "static", "tap_layers": g["taps"]}},
            "drafter": g["drafter"], "verify": {"plugin": "verifier"}}}
        path = tmp_path / name
        path.write_text(json.dumps(spec))
        report = greedy_gate(path, prompts=[[5, 6, 7, 8]], max_new_tokens=12)
        assert report.drafted > 0, name


@pytest.mark.parametrize("span", [None, 6])
def test_training_forward_matches_the_node_for_one_anchor(target, span):
    """The multi-anchor training forward gives the inference path's block hidden states for a single anchor; also
    with non-causal sliding-window layers whose window (6) is shorter than the context (11 rows)."""
    model = load_hf(target, "cpu", torch.float32).model
    cfg = new_config(model, num_layers=2, block_size=4, tap_layers=(0, 1), mask_token_id=255)
    if span is not None:
        cfg = attrs.evolve(cfg, layer_types=("sliding_attention",) * 2, sliding_window=span, is_causal=False)
    drafter = DFlashModel(cfg)
    init_weights(drafter, std=0.2, seed=3)
    tokens = torch.randint(0, 255, (1, 20), generator=torch.Generator().manual_seed(0))
    _, feats = model(tokens, 0, WindowKV(), logit_rows=0, tap_layers=(0, 1))
    anchor = 11
    block = torch.full((1, 4), 255)
    block[0, 0] = tokens[0, anchor]
    x = torch.nn.functional.embedding(block, model.embed_tokens.weight)
    with torch.no_grad():
        trained = block_hidden(drafter, feats, x, torch.tensor([[anchor]]))
        cache = KVCache.from_static(torch.zeros(2, 2, 1, 32, cfg.num_kv_heads, cfg.head_dim))
        served = drafter.draft(feats[:, :anchor], 0, x, cache)
    torch.testing.assert_close(trained, served, rtol=1e-5, atol=1e-5)


def test_missing_mask_token_is_explained(target, tmp_path):
    """A target tokenizer without a mask token asks for --mask-token-id."""
    with pytest.raises(DraftflowError, match="--mask-token-id"):
        train_main(["dflash", "--target", str(target), "--out", str(tmp_path / "x"), "--data", str(ROOT / "core"),
                    "--steps", "1", *SMALL])
