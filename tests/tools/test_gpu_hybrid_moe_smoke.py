"""benchmarks/gpu_hybrid_moe.py runs end to end on the CPU at toy shapes: both graphs through the executor, half resident."""

from __future__ import annotations

import json
import runpy
import sys

import pytest
from helpers import ROOT


def test_tiny_cpu_run_plans_and_steps_both_graphs(tmp_path, monkeypatch, capsys):
    """--tiny --device cpu: target-only and DFlash graphs open on aliased host experts, the planner's resident count
    runs (all for target-only, half with the drafter costed in), misses are counted, the table prints, and the
    loaders the benchmark replaced for its graphs are the real ones again afterwards."""
    monkeypatch.setattr(sys, "argv", ["gpu_hybrid_moe.py", "--tiny", "--device", "cpu", "--prompt", "16", "--cycles",
                                      "4", "--context", "128", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(ROOT / "benchmarks" / "gpu_hybrid_moe.py"), run_name="__main__")
    assert exc.value.code == 0
    r = json.loads((tmp_path / "results.json").read_text())
    only, spec = r["target-only"], r["dflash"]
    assert "error" not in only and "error" not in spec, (only, spec)
    assert only["resident"] == only["experts"] == 64 and only["hit_rate"] == 1.0
    assert spec["resident"] == 32 and spec["expert_costs"]["drafter"] == 32 and 0 < spec["hit_rate"] < 1
    assert spec["misses_per_token"] > 0 and spec["cycles"] >= 4 and only["tokens_per_cycle"] == 1.0
    assert r["floor"]["routed_experts"] == 4 * 4 * r["floor"]["bytes_per_expert"]
    assert "capturable windows" in capsys.readouterr().out
    from draftflow.plugins.dflash import plugin as dflash_plugin
    from draftflow.plugins.target import hf_loader

    assert hf_loader.load_hf.__name__ == "load_hf" and dflash_plugin.load_drafter.__name__ == "load_drafter"  # restored
