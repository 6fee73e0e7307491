"""The training loop's decoded acceptance (`loop.decode_acceptance`, `draftflow train --eval-decode-tokens`) is the
runtime's: on the small trained pair, the cycles, drafts and accepted drafts it counts are the executor's for the same
prompts, greedy, fixed K, float32."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT, SMALL_PAIR

from draftflow.core.node import SamplingParams
from draftflow.core.session import Session
from draftflow.plugins.dflash.model import DFlashModel
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.tools.train.dflash2_recipe import init_backbone_config, load_backbone
from draftflow.tools.train.dflash_recipe import DFlashRecipe
from draftflow.tools.train.loop import decode_acceptance, estimate_acceptance

NEW = 24


def test_decoded_tau_counts_the_executors_cycles(tmp_path):
    loaded = load_hf(SMALL_PAIR / "target", "cpu", torch.float32)
    model = loaded.model
    drafter = DFlashModel(init_backbone_config(SMALL_PAIR / "dflash", model))
    load_backbone(drafter, SMALL_PAIR / "dflash")
    cfg = drafter.config
    k = cfg.block_size - 1
    texts = [(ROOT / "core" / name).read_text()[:600] for name in ("executor.py", "spec.py", "registry.py")]
    windows = [torch.tensor(loaded.tokenizer.encode(t).ids[:96]) for t in texts]  # prompts: the first halves
    recipe = DFlashRecipe(model, drafter.eval())
    with torch.no_grad():
        estimate = decode_acceptance(model, windows, cfg.target_layer_ids, k, recipe.propose, NEW)
        both = estimate_acceptance(model, windows, cfg.target_layer_ids, k, recipe.propose, NEW)
    assert both["tau_decode"] == estimate["tau_decode"] and "tau" in both  # the one-cycle numbers and the decoded
    spec = {"name": "decode", "device": "cpu", "dtype": "float32", "num_draft": k, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(SMALL_PAIR / "target"), "kv_mode": "static",
                                                  "tap_layers": list(cfg.target_layer_ids)}},
        "drafter": {"plugin": "dflash", "params": {"path": str(SMALL_PAIR / "dflash")}},
        "verify": {"plugin": "verifier"}}}
    path = tmp_path / "decode.yaml"
    path.write_text(json.dumps(spec))
    session = Session.open(path)
    try:
        stats = [session.generate(w[:w.numel() // 2].tolist(),
                                  SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)).stats
                 for w in windows]
    finally:
        session.close()
    cycles, drafted, accepted = (sum(s[key] for s in stats) for key in ("cycles", "drafted", "accepted"))
    assert accepted > cycles // 2  # a drafter that accepts: the counts below are not trivially equal
    assert estimate["tau_decode"] == pytest.approx(len(windows) * NEW / cycles, abs=1e-12)
    assert estimate["acceptance_decode"] == pytest.approx(accepted / drafted, abs=1e-12)


def test_windows_of_two_lengths_give_what_each_window_gives_alone():
    """The target's continuations run batched per window length: with windows of two lengths, interleaved, the
    one-cycle and decoded numbers are those of each window evaluated alone (same counts, in any order)."""
    loaded = load_hf(SMALL_PAIR / "target", "cpu", torch.float32)
    model = loaded.model
    drafter = DFlashModel(init_backbone_config(SMALL_PAIR / "dflash", model))
    load_backbone(drafter, SMALL_PAIR / "dflash")
    k, taps = drafter.config.block_size - 1, drafter.config.target_layer_ids
    ids = loaded.tokenizer.encode((ROOT / "core" / "executor.py").read_text()[:4000]).ids
    windows = [torch.tensor(ids[i * 100:i * 100 + (96 if i % 2 else 80)]) for i in range(5)]  # 80, 96, 80, 96, 80
    recipe = DFlashRecipe(model, drafter.eval())
    with torch.no_grad():
        together = estimate_acceptance(model, windows, taps, k, recipe.propose, 12)
        alone = [estimate_acceptance(model, [w], taps, k, recipe.propose, 12) for w in windows]
    assert together["tau"] == pytest.approx(sum(a["tau"] for a in alone) / len(alone), abs=1e-12)
    assert together["first_token"] == pytest.approx(sum(a["first_token"] for a in alone) / len(alone), abs=1e-12)
    # tau_decode = tokens / cycles over all windows: each window alone emits 12 tokens in 12 / tau_decode cycles
    cycles = sum(12 / a["tau_decode"] for a in alone)
    assert together["tau_decode"] == pytest.approx(12 * len(windows) / cycles, abs=1e-9)
    assert 1.0 < together["tau"] and together["tau_decode"] > 1.0  # the drafter accepts: not trivially equal
