"""benchmarks/gpu_moe.py's executor rows (Session over the in-memory model) and aliased host experts, at toy shapes."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import ROOT


def test_session_rows_follow_the_plan_on_aliased_host_experts(tmp_path):
    """--alias-host-experts --fractions 0.5: the executor rows run at the planner's resident counts (the drafter's
    graph at the eager rows' count), count misses and syncs, and the results say the host experts were aliased."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_moe.py"), "--tiny", "--device", "cpu",
                           "--fractions", "0.5", "--prompt", "16", "--tokens", "4", "--no-kernel-sweep",
                           "--alias-host-experts", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["host_experts_aliased"] is True and res["kernel_tok_s"] == {}
    runs = {r["run"]: r for r in res["runs"]}
    spec = runs["session dflash (random), eager"]
    assert spec["resident"] == runs["dflash (random)"]["resident"] == res["experts"] // 2
    assert 0 < spec["hit_rate"] < 1 and spec["cycles"] >= 4 and spec["host_syncs_per_cycle"] == 0  # no CUDA: 0
    assert runs["session target-only, eager"]["resident"] == spec["plan_resident_target_only"]
    assert "session dflash (random), eager" in proc.stdout
