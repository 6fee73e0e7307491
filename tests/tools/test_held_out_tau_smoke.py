"""benchmarks/held_out_tau.py runs end to end on the CPU with the small trained pair and writes both estimates."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import ROOT, SMALL_PAIR


def test_both_estimates_for_each_drafter(tmp_path):
    out = tmp_path / "tau.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "held_out_tau.py"), "--demo", str(SMALL_PAIR),
                          "--windows", "3", "--seq-len", "64", "--decode-tokens", "12", "--max-data-mb", "0.3",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["windows"] == 3 and set(results["drafters"]) == {"DFlash", "DFlash2"}
    for row in results["drafters"].values():
        assert row["num_draft"] == 7 and 1.0 <= row["tau"] <= 8.0 and 1.0 <= row["tau_decode"] <= 8.0
    assert "tau_decode" in run.stdout and "DFlash2" in run.stdout
