"""`make_demo --stage dflash`: the documented way to rebuild the shipped drafters, on regenerated windows."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import ROOT

from draftflow.plugins.dflash.loader import read_artifact
from draftflow.tools.make_demo import main as make_demo


@pytest.mark.slow
def test_dflash_stage_trains_on_regenerated_windows(tmp_path):
    out, work = tmp_path / "demo", tmp_path / "work"
    shutil.copytree(ROOT / "graphs" / "models" / "demo" / "target", out / "target")
    assert make_demo(["--stage", "dflash", "--out", str(out), "--work", str(work), "--drafter-minutes", "0.05",
                      "--regen-windows", "32", "--drafter-data-mb", "1"]) == 0
    run = json.loads((work / "summary.json").read_text())["dflash"]  # the `draftflow train` summary
    argv = run["argv"]
    assert argv[argv.index("--labels") + 1] == "regenerate" and argv[argv.index("--regen-windows") + 1] == "32"
    assert run["steps"] > 0 and "tau" in run["evaluations"][-1][1]
    assert read_artifact(out / "dflash").config.block_size == 16 and (work / "dflash.gguf").exists()
