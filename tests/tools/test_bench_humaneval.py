"""The HumanEval benchmark runs end to end on a handful of prompts and reports every drafter."""

from __future__ import annotations

import json

from draftflow.tools.bench_humaneval import main


def test_benchmark_runs_on_a_few_prompts(tmp_path, capsys):
    """Two prompts, 12 tokens, T=0 and T=1: a table row per drafter, JSON with tau and speedup, a plot."""
    out, plot = tmp_path / "r.json", tmp_path / "p.png"
    assert main(["--limit", "2", "--max-new-tokens", "12", "--json", str(out), "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    assert "2 of 2 prompts fit" in printed
    results = json.loads(out.read_text())
    assert len(results) == 10  # 5 drafter configurations x 2 temperatures
    assert results["target only @ T=0"]["tau"] == 1.0 and results["target only @ T=0"]["speedup"] == 1.0
    assert results["MTP @ T=0"]["tau"] >= 1.0 and results["DFlash @ T=1"]["drafted"] > 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
