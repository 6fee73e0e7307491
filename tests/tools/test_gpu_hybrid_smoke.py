"""benchmarks/gpu_hybrid.py runs end to end on the CPU at toy shapes and writes its results."""

from __future__ import annotations

import json

from helpers import ROOT


def test_tiny_cpu_run_writes_every_table(tmp_path):
    """--tiny --device cpu: verify and rollback timings for dense, hybrid-select, hybrid-replay and re-forward."""
    import runpy
    import sys

    out = tmp_path / "r.json"
    argv = sys.argv
    sys.argv = ["gpu_hybrid.py", "--tiny", "--device", "cpu", "--reps", "1", "--context", "24", "--out", str(out)]
    try:
        runpy.run_path(str(ROOT / "benchmarks" / "gpu_hybrid.py"), run_name="__main__")
    except SystemExit as exc:
        assert exc.code == 0
    finally:
        sys.argv = argv
    r = json.loads(out.read_text())
    assert set(r["verify_ms"]) == {"dense", "hybrid-select", "hybrid-replay"}
    assert set(r["rollback_ms"]) == {"dense", "hybrid-select", "hybrid-replay", "hybrid-reforward"}
    assert r["state_bytes"]["hybrid-select"] > r["state_bytes"]["hybrid-replay"] > 0
