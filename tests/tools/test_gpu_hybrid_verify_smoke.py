"""benchmarks/gpu_hybrid_verify.py runs end to end on the CPU (Triton interpreter) at toy shapes and writes its results."""

from __future__ import annotations

import json
import runpy
import sys

import pytest
from helpers import ROOT


def test_tiny_cpu_run_writes_every_phase(tmp_path, monkeypatch, capsys):
    """--tiny --device cpu: floor, kernel and torch-loop windows, select rollback, the DFlash cycle through the executor
    and the one-layer timings, no errors."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(sys, "argv", ["gpu_hybrid_verify.py", "--tiny", "--device", "cpu", "--reps", "1",
                                      "--context", "8", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(ROOT / "benchmarks" / "gpu_hybrid_verify.py"), run_name="__main__")
    assert exc.value.code == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["floor"]["T=16"]["state_writes"] == 16 * r["floor"]["T=1"]["state_writes"] > 0
    for phase in ("windows, kernels", "windows, torch loop", "select rollback ms", "dflash cycle", "gdn mixer"):
        assert "error" not in r[phase] and "skipped" not in r[phase], r[phase]
    assert set(r["windows, kernels"]) == {"graph T=1", "graph T=4", "eager T=1", "eager T=4", "spread"}
    cycle = r["dflash cycle"]
    assert cycle["cycles"] >= 2 and cycle["tokens_per_cycle"] >= 1 and cycle["cycle_ms"] > 0
    assert cycle["floors_ms"] == cycle["floor_target_window16_ms"] + cycle["floor_drafter_ms"] > 0
    assert cycle["drafter_bytes"]["lm_head"] > 0 and cycle["drafter"]["layer_types"][-1] == "full_attention"
    out = capsys.readouterr().out
    assert "kernels, graph" in out and "DFlash cycle through the executor" in out


def test_deadline_skips_later_phases(tmp_path, monkeypatch):
    """A baseline phase that would start past --deadline-s is recorded as skipped, the issue's phases still run."""
    monkeypatch.setattr(sys, "argv", ["gpu_hybrid_verify.py", "--tiny", "--device", "cpu", "--reps", "1", "--context",
                                      "8", "--phases", "rollback,mixer", "--deadline-s", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(ROOT / "benchmarks" / "gpu_hybrid_verify.py"), run_name="__main__")
    assert exc.value.code == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert "skipped" in r["gdn mixer"] and "windows, kernels" not in r
    assert "error" not in r["select rollback ms"] and "skipped" not in r["select rollback ms"]
