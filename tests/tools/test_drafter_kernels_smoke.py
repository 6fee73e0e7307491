"""benchmarks/drafter_kernels.py prints a row per graph and setting and writes them to results.json."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import ROOT, SMALL_PAIR


def test_prints_and_writes_the_plain_path_on_the_cpu(tmp_path):
    """On the CPU: the plain path only (no `triton` row), eager, its aten ops counted and timed."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "drafter_kernels.py"), "--device", "cpu", "--graphs",
                        str(SMALL_PAIR / "demo-dflash2.yaml"), "--calls", "2", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(row["graph"], row["triton"], row["path"], row["unit"]) for row in rows] == \
        [("demo-dflash2.yaml", False, "eager", "aten ops")]
    assert rows[0]["us_per_proposal"] > 0 and rows[0]["launches"] > 50, rows
    assert "demo-dflash2.yaml" in r.stdout and "aten ops" in r.stdout
