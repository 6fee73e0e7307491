"""`draftflow generate --compare`: the same request on the graph's target alone, speed and identity reported."""

from __future__ import annotations

import json

from helpers import SMALL_PAIR, run_cli

from draftflow.core.compare import target_only_graph
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


def test_compare_reports_the_target_only_run_through_the_cli():
    args = ["generate", "def fibonacci(n):", "--graph", str(GRAPH), "--max-new-tokens", "24", "--compare"]
    r = run_cli(args + ["--json"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    compare = out["compare"]
    assert compare["identical"] is True and compare["target_only_tokens_per_s"] > 0
    assert abs(compare["speedup"] - out["stats"]["tokens_per_s"] / compare["target_only_tokens_per_s"]) < 0.01
    line = run_cli(args).stderr.strip().splitlines()[-1]
    assert "; target only " in line and "speedup" in line and line.endswith("same tokens]"), line
