"""benchmarks/gpu_hybrid_verify.py runs end to end on the CPU (Triton interpreter) at toy shapes and writes its results."""

from __future__ import annotations

import json
import runpy
import sys

import pytest
from helpers import ROOT


def test_tiny_cpu_run_writes_every_phase(tmp_path, monkeypatch, capsys):
    """--tiny --device cpu: floor, kernel and torch-loop windows, select rollback and the one-layer timings, no errors."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(sys, "argv", ["gpu_hybrid_verify.py", "--tiny", "--device", "cpu", "--reps", "1",
                                      "--context", "8", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(ROOT / "benchmarks" / "gpu_hybrid_verify.py"), run_name="__main__")
    assert exc.value.code == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["floor"]["T=16"]["state_writes"] == 16 * r["floor"]["T=1"]["state_writes"] > 0
    for phase in ("windows, kernels", "windows, torch loop", "select rollback ms", "gdn mixer"):
        assert "error" not in r[phase], r[phase]
    assert set(r["windows, kernels"]) == {"graph T=1", "graph T=4", "eager T=1", "eager T=4"}
    assert "kernels, graph" in capsys.readouterr().out
