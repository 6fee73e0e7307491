"""`draftflow generate --compare`: the same request on the graph's target alone, speed and identity reported."""

from __future__ import annotations

import json
import statistics

import pytest

from helpers import SMALL_PAIR, run_cli

from draftflow.core.compare import ROUNDS, target_only_graph
from draftflow.core.registry import load_registry
from draftflow.core.plan import build_plan
from draftflow.core.spec import load_graph

GRAPH = SMALL_PAIR / "demo.yaml"


def test_target_only_graph_keeps_the_target_and_verifier_alone():
    plan = build_plan(load_graph(GRAPH), load_registry())
    graph = target_only_graph(plan)
    assert sorted(graph["nodes"]) == ["target", "verify"] and graph["num_draft"] == 0
    target = graph["nodes"]["target"]["params"]
    assert target["tap_layers"] == [] and target["path"] == str(SMALL_PAIR / "target")  # absolute, not YAML-relative
    assert target["kv_mode"] == "static"


def test_compare_reports_the_median_of_its_rounds_through_the_cli(tmp_path):
    trace = tmp_path / "t.jsonl"
    args = ["generate", "def fibonacci(n):", "--graph", str(GRAPH), "--max-new-tokens", "24", "--compare"]
    r = run_cli(args + ["--json", "--trace", str(trace)])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    compare = out["compare"]
    rounds = compare["rounds"]
    assert len(rounds) == ROUNDS == 3 and compare["identical"] is True
    assert rounds[0]["tokens_per_s"] == out["stats"]["tokens_per_s"]  # round 1 is the printed run
    for r_ in rounds:
        assert r_["target_only_tokens_per_s"] > 0
        assert abs(r_["speedup"] - r_["tokens_per_s"] / r_["target_only_tokens_per_s"]) < 0.01
    assert compare["speedup"] == round(statistics.median(r_["speedup"] for r_ in rounds), 3)
    assert compare["target_only_tokens_per_s"] == statistics.median(r_["target_only_tokens_per_s"] for r_ in rounds)
    requests = {json.loads(line)["request_id"] for line in trace.read_text().splitlines()
                if "request_id" in json.loads(line)}
    assert len(requests) == 1  # the repeated rounds are not traced
    line = run_cli(args).stderr.strip().splitlines()[-1]
    assert "; target only " in line and "speedup" in line and "(median of 3 rounds)" in line, line
    assert line.endswith("same tokens]"), line


def test_one_compare_round_pairs_the_printed_run_with_one_target_only_run():
    args = ["generate", "def fibonacci(n):", "--graph", str(GRAPH), "--max-new-tokens", "16", "--compare",
            "--compare-rounds", "1", "--json"]
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    compare = out["compare"]
    assert len(compare["rounds"]) == 1 and compare["identical"] is True
    assert abs(compare["speedup"] - out["stats"]["tokens_per_s"] / compare["target_only_tokens_per_s"]) < 0.01


@pytest.mark.parametrize("extra", [["--compare", "--compare-rounds", "0"], ["--compare-rounds", "2"]])
def test_compare_rounds_needs_a_positive_count_and_compare(extra):
    r = run_cli(["generate", "def f(x):", "--graph", str(GRAPH), "--max-new-tokens", "4", *extra])
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: --compare-rounds {extra[-1]}: give a positive number of rounds, with --compare"
    assert r.stdout == ""
