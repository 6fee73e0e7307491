"""benchmarks/gpu_quant.py runs end to end on the CPU at toy shapes (Triton's interpreter) and writes its results,
including the DFlash cycle through the executor on a kept-quantized, repacked target."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT

pytest.importorskip("triton")


def test_tiny_run_measures_the_dflash_cycle_on_a_quantized_target(tmp_path):
    out = tmp_path / "q"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_quant.py"), "--tiny", "--quick", "--no-projections",
                          "--configs", "bf16,q8_0+r", "--dflash-configs", "q8_0+r", "--stages", "2,3", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    configs = results["configs"]
    assert results["stages"] == {"rows kernel": {"4": 2, "8": 2}, "split-K kernel": 3}  # --stages: pipelined loops
    assert "dflash" not in configs["bf16"] and configs["q8_0+r"]["gemv_rel_err"] < 1e-2
    d = configs["q8_0+r"]["dflash"]
    assert d["cycles"] > 0 and d["tokens_per_cycle"] >= 1 and d["cycle_in_target_steps"] > 0
    assert "q8_0+r: DFlash cycle (" in run.stdout


def test_a_malformed_stages_pair_is_one_error_line(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_quant.py"), "--tiny", "--stages", "3",
                          "--out", str(tmp_path / "q")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].endswith("argument --stages: '3': give two positive integers, e.g. 1,1")
    assert not (tmp_path / "q").exists()
