"""`draftflow train mtp --mtp-layout qwen3-next`: an MTP head that shares the target's LM head."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT
from safetensors import safe_open

from draftflow.plugins.mtp.weights import LAYOUTS, find_mtp
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.testing import greedy_gate
from draftflow.tools.tiny_model import write_tiny_model
from draftflow.tools.train.cli import build_parser
from draftflow.tools.train.cli import main as train_main
from draftflow.tools.train.mtp_recipe import new_head

SMALL = ["--seq-len", "64", "--batch-size", "4", "--eval-windows", "2", "--eval-every", "0", "--save-every", "0",
         "--max-data-mb", "0.2", "--lr", "3e-3", "--warmup", "0.1", "--device", "cpu", "--data", str(ROOT / "core")]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("mtp_layout") / "target", vocab=256, hidden=32, layers=2, heads=4,
                            kv_heads=2, intermediate=64, context=256)


@pytest.fixture(scope="module")
def hybrid_target(tmp_path_factory):
    """A Qwen3-Next-style target: its norms scale by (1 + w)."""
    return write_tiny_model(tmp_path_factory.mktemp("mtp_layout_hybrid") / "target", vocab=256, hidden=32, layers=4,
                            heads=4, kv_heads=2, intermediate=64, context=256, hybrid=True)


def test_the_flag_offers_the_loaders_layouts():
    flag = next(a for a in build_parser()._actions if a.dest == "mtp_layout")
    assert tuple(flag.choices) == LAYOUTS


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-next"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_fresh_head_ends_in_the_targets_final_norm_and_lm_head(target, hybrid_target, kind, layout):
    """At step 0 either layout's output norm scales as the target's final norm (x̂·w or x̂·(1+w) on either side), its
    other norms have unit gains, and its LM head is the target's (qwen3-next: the same tensor; deepseek-v3: a copy),
    so both start from the target's own next-token readout."""
    model = load_hf(target if kind == "qwen3" else hybrid_target, "cpu", torch.float32).model
    assert model.config.norm_offset == (kind == "qwen3-next")
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)  # not all ones: a wrong offset shows
        head = new_head(model, seed=1, layout=layout)
        x = torch.randn(3, 32)
        assert torch.allclose(head.out_norm(x), model.norm(x), atol=1e-6)
        for name, norm in head.named_modules():  # every other norm of the head starts with unit gains
            if hasattr(norm, "eps") and getattr(norm, "weight", None) is not None and name != "out_norm":
                y = x[:, : norm.weight.shape[0]]
                assert torch.allclose(norm(y), y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + norm.eps), atol=1e-6), name
    if layout == "qwen3-next":
        assert not hasattr(head, "head") and head.shared_head is model.head_weight()
    else:
        assert torch.equal(head.head.weight, model.head_weight()) and head.head.weight is not model.head_weight()


def _train(target, out, layout):
    summary = out.parent / f"{out.name}.json"
    assert train_main(["mtp", "--target", str(target), "--out", str(out), "--steps", "30", "--summary", str(summary),
                       "--mtp-layout", layout, *SMALL]) == 0
    return json.loads(summary.read_text())


def test_cli_trains_a_qwen3_next_head_without_an_lm_head_that_the_node_loads(target, tmp_path):
    """The run lowers its loss and writes `mtp.*` names with no LM head (the file is vocab x hidden float32 weights
    smaller than the deepseek-v3 run's); the mtp node finds the layout by itself and stays lossless."""
    runs = {layout: _train(target, tmp_path / layout, layout) for layout in LAYOUTS}
    s = runs["qwen3-next"]
    assert s["steps"] == 30 and s["last_loss"] < s["first_loss"] - 0.3, s
    with safe_open(str(tmp_path / "qwen3-next" / "mtp.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names and all(n.startswith("mtp.") for n in names) and "mtp.fc.weight" in names
    assert not any("head" in n for n in names) and "mtp.layers.0.self_attn.q_proj.weight" in names
    sizes = {layout: (tmp_path / layout / "mtp.safetensors").stat().st_size for layout in LAYOUTS}
    assert sizes["deepseek-v3"] - sizes["qwen3-next"] == pytest.approx(256 * 32 * 4, abs=512)
    assert find_mtp(str(tmp_path / "qwen3-next")).layout == "qwen3-next"
    spec = {"name": "q3n", "device": "cpu", "dtype": "float32", "num_draft": 2, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(target), "kv_mode": "static", "tap_layers": [1]}},
        "drafter": {"plugin": "mtp", "params": {"path": str(tmp_path / "qwen3-next")}}, "verify": {"plugin": "verifier"}}}
    path = tmp_path / "q3n.yaml"
    path.write_text(json.dumps(spec))
    report = greedy_gate(path, prompts=[[5, 6, 7, 8]], max_new_tokens=12)
    assert report.drafted > 0

