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
