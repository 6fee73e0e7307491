"""The adaptive_k node through its public entry points: a YAML graph and the CLI's trace."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT, run_cli, SMALL_PAIR

from draftflow.core.errors import ModelFormatError
from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import load_graph

DEMO_GRAPH = SMALL_PAIR / "demo.yaml"


def test_the_default_graph_chooses_k_per_cycle_and_stays_exact(tmp_path):
    """graphs/demo.yaml drafts with adaptive_k: K varies in the trace, the tokens are the target's alone."""
    trace = tmp_path / "trace.jsonl"
    args = ["generate", "def fibonacci(n):", "--graph", str(DEMO_GRAPH), "--max-new-tokens", "64", "--ignore-eos",
            "--json"]
    r = run_cli(args + ["--trace", str(trace)])
    assert r.returncode == 0, r.stderr
    ks = [json.loads(line)["k"] for line in trace.read_text().splitlines() if '"draft_cycle"' in line]
    assert ks[0] == 7 and 0 in ks[:3], ks  # both ends measured first
    assert len(set(ks)) >= 2
    plain = run_cli(args + ["--set", "num_draft=0"])
    assert json.loads(r.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]


def test_a_second_policy_is_a_check_problem(tmp_path):
    graph = DEMO_GRAPH.read_text().replace("path: ./", f"path: {SMALL_PAIR}/")
    (tmp_path / "g.yaml").write_text(graph + "  policy2:\n    plugin: adaptive_k\n")
    r = run_cli(["check", str(tmp_path / "g.yaml")])
    assert r.returncode != 0
    assert "[role]" in r.stderr and "a second draft-length policy (the first is 'policy')" in r.stderr


def test_a_policy_answer_outside_the_range_is_refused(monkeypatch):
    from draftflow.plugins.policy.plugin import AdaptiveK

    monkeypatch.setattr(AdaptiveK, "choose_draft", lambda self, batch: batch.num_draft + 1)
    ex = Executor(build_plan(load_graph(DEMO_GRAPH), load_registry()))
    state = ex.start([5, 6, 7], SamplingParams(max_new_tokens=8))
    with pytest.raises(ModelFormatError, match=r"chose K=8; a policy's choose_draft must return an integer in \[0, 7\]"):
        ex.step([state])


def test_sampled_only_leaves_greedy_cycles_at_num_draft_and_chooses_for_sampled_ones(tmp_path):
    """`sampled_only: true` in YAML: a greedy request drafts num_draft every cycle (without it the policy measures
    K = 0 among its first cycles); an unseeded sampled request gets the policy's choices, K = 0 among them."""
    graph = DEMO_GRAPH.read_text().replace("path: ./", f"path: {SMALL_PAIR}/")
    (tmp_path / "on.yaml").write_text(graph.rstrip("\n").split("  policy:")[0]
                                      + "  policy:\n    plugin: adaptive_k\n    params:\n      sampled_only: true\n")
    (tmp_path / "off.yaml").write_text(graph)

    def ks(name, *extra):
        trace = tmp_path / f"{name}{len(extra)}.jsonl"
        r = run_cli(["generate", "def fibonacci(n):", "--graph", str(tmp_path / name), "--max-new-tokens", "48",
                     "--ignore-eos", "--json", "--trace", str(trace), *extra])
        assert r.returncode == 0, r.stderr
        cycles = [json.loads(line) for line in trace.read_text().splitlines() if '"draft_cycle"' in line]
        # the last cycles draft at most what is left of the token budget
        return [c["k"] for c in cycles if 48 - c["position"] + cycles[0]["position"] > 8], json.loads(r.stdout)

    greedy, out = ks("on.yaml")
    assert greedy and set(greedy) == {7}, greedy
    assert 0 in ks("off.yaml")[0][:3]  # the same request under the plain policy: both ends measured first
    sampled, _ = ks("on.yaml", "--temperature", "1")
    assert 0 in sampled[:3] and len(set(sampled)) >= 2, sampled
    plain = run_cli(["generate", "def fibonacci(n):", "--graph", str(tmp_path / "on.yaml"), "--max-new-tokens", "48",
                     "--ignore-eos", "--json", "--set", "num_draft=0"])
    assert out["token_ids"] == json.loads(plain.stdout)["token_ids"]


def test_a_sampled_only_that_is_not_a_bool_is_one_line_naming_node_and_param(tmp_path):
    graph = DEMO_GRAPH.read_text().replace("path: ./", f"path: {SMALL_PAIR}/")
    path = tmp_path / "g.yaml"
    path.write_text(graph.rstrip("\n") + "\n    params:\n      sampled_only: maybe\n")
    before = path.read_text()
    r = run_cli(["check", str(path)])
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "parameter 'sampled_only'" in ln]
    assert len(lines) == 1 and "node 'policy'" in lines[0], r.stderr
    assert path.read_text() == before
