"""`make_demo --stage dflash`: the documented way to rebuild the shipped drafters, on regenerated windows."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import ROOT, SMALL_PAIR

from draftflow.plugins.dflash.loader import read_artifact
from draftflow.tools.make_demo import build_parser, drafter_args
from draftflow.tools.make_demo import main as make_demo


@pytest.mark.slow
def test_dflash_stage_trains_on_regenerated_windows(tmp_path):
    out, work = tmp_path / "demo", tmp_path / "work"
    shutil.copytree(SMALL_PAIR / "target", out / "target")  # the small trained twin: the mechanics, in seconds
    assert make_demo(["--stage", "dflash", "--out", str(out), "--work", str(work), "--drafter-minutes", "0.05",
                      "--regen-windows", "32", "--drafter-data-mb", "1", "--eval-windows", "2", "--anchors", "16",
                      "--drafter-seq-len", "96", "--eval-decode-tokens", "6", "--regen-body-share", "0.5"]) == 0
    run = json.loads((work / "summary.json").read_text())["dflash"]  # the `draftflow train` summary
    argv = run["argv"]
    assert argv[argv.index("--labels") + 1] == "regenerate" and argv[argv.index("--regen-windows") + 1] == "32"
    assert argv[argv.index("--anchors") + 1] == "16" and argv[argv.index("--seq-len") + 1] == "96"
    assert run["steps"] > 0 and {"tau", "tau_decode"} <= set(run["evaluations"][-1][1])
    assert argv[argv.index("--eval-decode-tokens") + 1] == "6" and argv[argv.index("--regen-body-share") + 1] == "0.5"
    assert read_artifact(out / "dflash").config.block_size == 16 and (work / "dflash.gguf").exists()
    # --continue-dflash: the next run starts from that drafter (a copy in WORK), on windows of another seed
    assert make_demo(["--stage", "dflash", "--out", str(out), "--work", str(work), "--drafter-minutes", "0.05",
                      "--regen-windows", "32", "--drafter-data-mb", "1", "--eval-windows", "2", "--continue-dflash", "--seed", "1", "--anchors", "16",
                      "--dflash-lr", "1e-3", "--drafter-seq-len", "96"]) == 0
    argv = json.loads((work / "summary.json").read_text())["dflash"]["argv"]
    assert argv[argv.index("--init-from") + 1] == str(work / "dflash-start") and "--layers" not in argv
    assert argv[argv.index("--lr") + 1] == "0.001" and argv[argv.index("--seed") + 1] == "1"
    assert read_artifact(out / "dflash").config.target_layer_ids == read_artifact(work / "dflash-start").config.target_layer_ids


def test_continue_dflash_without_a_drafter_is_one_error_line(tmp_path):
    """--continue-dflash with no OUT/dflash to continue: one `error:` line naming the folder and the fix, before any
    training, and nothing written into OUT."""
    out = tmp_path / "demo"
    out.mkdir()
    with pytest.raises(SystemExit) as exc:
        make_demo(["--stage", "dflash", "--out", str(out), "--work", str(tmp_path / "work"), "--continue-dflash"])
    assert str(exc.value) == (f"error: --continue-dflash: no DFlash drafter in {out / 'dflash'}; train one first "
                              "(--stage dflash without --continue-dflash)")
    assert list(out.iterdir()) == []


def test_a_drafter_argument_train_refuses_is_one_error_line(tmp_path, capsys):
    """--eval-windows -1 reaches `draftflow train`'s checks: make_demo prints its one line, returns 1, and OUT is
    untouched (no traceback, nothing trained)."""
    out = tmp_path / "demo"
    out.mkdir()
    assert make_demo(["--stage", "dflash", "--out", str(out), "--work", str(tmp_path / "work"),
                      "--eval-windows", "-1"]) == 1
    assert capsys.readouterr().err == "error: --eval-windows -1: must be at least 0 (held-out windows)\n"
    assert list(out.iterdir()) == []
    # --drafter-seq-len too short for a 16-row block: train's one line, before it reads any text or loads the target
    shutil.copytree(ROOT / "graphs" / "models" / "demo" / "target", out / "target")
    assert make_demo(["--stage", "dflash", "--out", str(out), "--work", str(tmp_path / "work"),
                      "--drafter-seq-len", "8"]) == 1
    assert capsys.readouterr().err == ("error: --seq-len 8 leaves no room for a block of 16 after the first token; use "
                                       "--seq-len of at least 17\n")
    assert [p.name for p in out.iterdir()] == ["target"]


def test_anchors_out_of_range_is_one_error_line(tmp_path, capsys):
    """--anchors 0 (make_demo's own flag, passed on to `draftflow train`): one line, exit 1, OUT untouched."""
    out = tmp_path / "demo"
    out.mkdir()
    assert make_demo(["--stage", "dflash", "--out", str(out), "--work", str(tmp_path / "work"), "--anchors", "0"]) == 1
    assert capsys.readouterr().err == "error: --anchors 0: must be at least 1 (blocks per window)\n"
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("layout", ["deepseek-v3", "qwen3-next"])
def test_mtp_stage_passes_its_layout_to_train(tmp_path, layout):
    """--mtp-layout reaches `draftflow train mtp` (qwen3-next unless given: the size cap); block drafters get no
    such flag."""
    flags = [] if layout == "qwen3-next" else ["--mtp-layout", layout]
    a = build_parser().parse_args(flags)
    argv = drafter_args("mtp", a, tmp_path / "demo", tmp_path / "work")
    assert argv[0] == "mtp" and argv[argv.index("--mtp-layout") + 1] == layout
    assert "--mtp-layout" not in drafter_args("dflash", a, tmp_path / "demo", tmp_path / "work")
