"""benchmarks/gpu_moe.py runs on the CPU at toy shapes (a smoke test of the GPU benchmark)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import ROOT


def test_gpu_moe_benchmark_tiny_cpu_smoke(tmp_path):
    """--tiny --device cpu prints the sweep and writes results whose resident counts follow the plan."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_moe.py"), "--tiny", "--device", "cpu",
                           "--fractions", "1.0,0.5", "--prompt", "16", "--tokens", "8", "--no-session", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "one miss: upload" in proc.stdout
    res = json.loads(out.read_text())
    runs = {(r["fraction"], r["run"]): r for r in res["runs"]}
    assert runs[(1.0, "dflash (random)")]["resident"] == res["experts"]
    half = runs[(0.5, "dflash (random)")]
    assert half["resident"] == res["experts"] // 2 and half["tokens"] >= 8
    assert half["plan_resident_target_only"] == half["plan_resident_spec"] + half["drafter_cost_experts"]
    assert runs[(0.5, "target-only @spec")]["hit_rate"] < 1.0 == runs[(1.0, "target-only @spec")]["hit_rate"]
