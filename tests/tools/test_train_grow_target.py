"""Growing a trained target deeper (tools/train/grow_target.py, `make_demo --grow-from`): the grown model computes what the
trained one did, and its block drafters' taps follow their layers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from helpers import SMALL_PAIR

from draftflow.core.errors import DraftflowError
from draftflow.plugins.dflash.loader import read_artifact
from draftflow.tools.make_demo import main as make_demo
from draftflow.tools.make_demo import spread_taps
from draftflow.tools.train.grow_target import grow_target, layer_map, retap_drafter
from draftflow.tools.train.loop import WindowKV


def test_layer_map_spreads_the_inserted_layers():
    assert layer_map(9, 11) == [0, 1, 2, None, 3, 4, 5, None, 6, 7, 8]
    assert layer_map(4, 6) == [0, None, 1, 2, None, 3]
    assert layer_map(4, 5) == [0, 1, None, 2, 3]
    assert layer_map(3, 3) == [0, 1, 2]
    for old, new in ((2, 6), (1, 4), (3, 10), (9, 11)):  # every layer placed once, the trained ones in order
        grown = layer_map(old, new)
        assert len(grown) == new and [i for i in grown if i is not None] == list(range(old))
    with pytest.raises(DraftflowError, match="grow to 2 layers: fewer than the trained target's 3"):
        layer_map(3, 2)


def test_grown_target_computes_what_the_trained_one_did():
    trained, _, _ = grow_target(SMALL_PAIR / "target", 4)  # no layer added: the trained model itself
    grown, config, mapping = grow_target(SMALL_PAIR / "target", 6, seed=3)
    assert config["num_hidden_layers"] == 6 and len(grown.layers) == 6 and mapping == [0, None, 1, 2, None, 3]
    assert all(p.requires_grad for p in grown.parameters())
    inserted = grown.layers[1]
    assert not inserted.self_attn.o_proj.weight.any() and inserted.self_attn.q_proj.weight.any()
    tokens = torch.randint(0, config["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, want_taps = trained(tokens, 0, WindowKV(), tap_layers=(1, 2, 3))
        got, got_taps = grown(tokens, 0, WindowKV(), tap_layers=(2, 3, 5))  # the same layers at their new indices
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_taps, want_taps, rtol=0, atol=1e-5)


def test_retap_drafter_moves_taps_and_refuses_a_foreign_drafter(tmp_path):
    taps = retap_drafter(SMALL_PAIR / "dflash2", tmp_path / "d2", layer_map(4, 6))
    assert taps == [2, 3, 5]
    cfg = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [2, 3, 5] and cfg["num_target_layers"] == 6
    assert cfg["dflash_config"]["selector_rank"] == json.loads((SMALL_PAIR / "dflash2" / "config.json").read_text())[
        "dflash_config"]["selector_rank"] and (tmp_path / "d2" / "model.safetensors").is_file()
    with pytest.raises(DraftflowError, match=r"taps \[1, 2, 3\] do not fit a target of 2 layers"):
        retap_drafter(SMALL_PAIR / "dflash", tmp_path / "d", [0, None, 1])


@pytest.mark.slow
def test_make_demo_grows_the_target_and_retaps_its_drafters(tmp_path):
    """`make_demo --stage target --grow-from`: the grown target trains from the trained one (its held-out loss before
    training is the trained target's), is saved with the new depth, and the drafters beside it are copied to OUT with
    moved taps; the DFlash node then loads them against the grown target."""
    src = tmp_path / "old"
    for kind in ("target", "dflash", "dflash2"):
        shutil.copytree(SMALL_PAIR / kind, src / kind)
    out, work = tmp_path / "demo", tmp_path / "work"
    assert make_demo(["--stage", "target", "--out", str(out), "--work", str(work), "--grow-from", str(src / "target"),
                      "--target-layers", "6", "--target-minutes", "0.02", "--data-mb", "0.3", "--target-seq-len", "64",
                      "--eval-every", "100000"]) == 0
    run = json.loads((work / "summary.json").read_text())["target"]
    assert run["layer_map"] == [0, None, 1, 2, None, 3] and run["retapped"] == {"dflash": [2, 3, 5],
                                                                                "dflash2": [2, 3, 5]}
    assert run["steps"] > 0 and run["shape"]["layers"] == 6 and 0 < run["held_out_before"] < 10
    assert json.loads((out / "target" / "config.json").read_text())["num_hidden_layers"] == 6
    assert (out / "target" / "tokenizer.json").read_bytes() == (src / "target" / "tokenizer.json").read_bytes()
    assert read_artifact(out / "dflash").config.target_layer_ids == (2, 3, 5)
    assert json.loads((src / "dflash" / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 2, 3]


def test_grow_from_a_folder_without_a_target_is_one_error_line(tmp_path, capsys):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text("{}")
    assert make_demo(["--stage", "target", "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w"),
                      "--grow-from", str(tmp_path / "t")]) == 1
    assert capsys.readouterr().err == (f"error: --grow-from {tmp_path / 't'}: no model.safetensors, tokenizer.json; "
                                       "give a trained target's folder (config.json, model.safetensors, "
                                       "tokenizer.json)\n")
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_make_demo_grow_train_new_trains_only_the_inserted_layers(tmp_path):
    """`--grow-train new`: only the inserted layers are trained; every trained layer, the embeddings and the final norm
    are saved bit for bit as they were."""
    out, work = tmp_path / "demo", tmp_path / "work"
    assert make_demo(["--stage", "target", "--out", str(out), "--work", str(work), "--grow-from",
                      str(SMALL_PAIR / "target"), "--target-layers", "6", "--grow-train", "new", "--target-minutes",
                      "0.02", "--data-mb", "0.3", "--target-seq-len", "64", "--eval-every", "100000",
                      "--save-dtype", "float32", "--target-lr", "1e-2"]) == 0
    run = json.loads((work / "summary.json").read_text())["target"]
    assert run["steps"] > 0 and run["trained_parameters"] < run["parameters"]
    old = {k.removeprefix("model."): v.float()
           for k, v in load_file(str(SMALL_PAIR / "target" / "model.safetensors")).items()}
    new = {k.removeprefix("model."): v for k, v in load_file(str(out / "target" / "model.safetensors")).items()}
    inserted = 0
    for i, j in enumerate(run["layer_map"]):
        names = sorted(k for k in new if k.startswith(f"layers.{i}."))
        if j is None:
            inserted += sum(new[k].numel() for k in names)
        else:
            assert all(torch.equal(new[k], old[k.replace(f"layers.{i}.", f"layers.{j}.", 1)]) for k in names)
    assert run["trained_parameters"] == inserted  # exactly the inserted layers were handed to the optimizer
    assert torch.equal(new["embed_tokens.weight"], old["embed_tokens.weight"]) and torch.equal(new["norm.weight"],
                                                                                              old["norm.weight"])


def test_grow_to_fewer_layers_is_one_error_line_before_any_text_is_read(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("draftflow.tools.make_demo.source_files", lambda: pytest.fail("text read before the check"))
    assert make_demo(["--stage", "target", "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w"),
                      "--grow-from", str(SMALL_PAIR / "target"), "--target-layers", "3"]) == 1
    assert capsys.readouterr().err == ("error: grow to 3 layers: fewer than the trained target's 4; pick at least "
                                       "4\n")
    assert not (tmp_path / "o").exists()


def test_grow_train_new_without_grow_from_is_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("draftflow.tools.make_demo.source_files", lambda: pytest.fail("text read before the check"))
    assert make_demo(["--stage", "target", "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w"),
                      "--grow-train", "new"]) == 1
    assert capsys.readouterr().err == ("error: --grow-train new trains only the layers --grow-from inserts; give "
                                       "--grow-from TARGET_DIR or drop --grow-train\n")
    assert not (tmp_path / "o").exists() and not (tmp_path / "w").exists()  # nothing written


def test_fresh_block_drafters_spread_three_taps_over_the_target():
    assert spread_taps(9) == (1, 4, 7) and spread_taps(11) == (1, 5, 9) and spread_taps(4) == (1, 2, 3)
