"""The block drafters' `defer` input: a cycle where another drafter's proposal is long enough drafts nothing here.

Wired as `lookup.proposal -> drafter.defer` next to a mixer that prefers prompt lookup, the
DFlash node skips exactly the cycles whose drafts the mixer would have thrown away: the
tokens and every cycle's drafts stay those of the same graph without the edge.
"""

from __future__ import annotations

import json

import yaml
from helpers import SMALL_PAIR, run_cli

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import load_graph

PROMPT = [3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 7, 8, 3, 4, 5]  # repeats: prompt lookup finds matches


def _graph(path, defer: bool, drafter: str = "dflash", defer_min: int = 2):
    nodes = {"target": {"plugin": "target", "params": {"path": str(SMALL_PAIR / "target"), "kv_mode": "static",
                                                        "tap_layers": [1, 2, 3]}},
             "lookup": {"plugin": "prompt-lookup"},
             "drafter": {"plugin": "dflash", "params": {"path": str(SMALL_PAIR / "dflash"), "defer_min": defer_min}},
             "mix": {"plugin": "mixer", "params": {"inputs": ["a", "b"], "min_tokens": 2}},
             "verify": {"plugin": "verifier"}}
    edges = ["lookup.proposal -> mix.a", "drafter.proposal -> mix.b", "mix.proposal -> target.proposal",
             "mix.proposal -> verify.proposal"]
    if drafter == "dflash2":
        nodes["drafter"] = {"plugin": "dflash2", "params": {"path": str(SMALL_PAIR / "dflash2"), "defer_min": defer_min}}
        nodes["selector"] = {"plugin": "dflash2-selector"}
        edges[1] = "selector.proposal -> mix.b"
    if defer:
        edges.append("lookup.proposal -> drafter.defer")
    path.write_text(yaml.safe_dump({"name": "defer", "device": "cpu", "dtype": "float32", "num_draft": 7,
                                    "nodes": nodes, "edges": edges}))
    return path


class _Drafts:
    def __init__(self):
        self.cycles = []

    def draftflow_cycle_event(self, event):
        self.cycles.append((tuple(event["draft"]), event["accepted"]))


def _run(graph):
    registry = load_registry()
    ex = Executor(build_plan(load_graph(graph), registry), hook=registry.pm.hook)
    sink = _Drafts()
    registry.pm.register(sink)
    model, forwards = ex.nodes["drafter"].model, []
    real = model.draft
    model.draft = lambda *a, **k: forwards.append(1) or real(*a, **k)
    out = ex.generate(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True))
    return out, sink.cycles, len(forwards), ex.nodes["mix"].chosen


def test_deferring_to_prompt_lookup_skips_the_drafts_the_mixer_drops(tmp_path):
    """Same tokens and the same drafts every cycle; the drafter runs only in cycles where lookup offered < 2."""
    want, want_cycles, all_forwards, chosen = _run(_graph(tmp_path / "plain.yaml", defer=False))
    got, got_cycles, forwards, chosen_deferring = _run(_graph(tmp_path / "defer.yaml", defer=True))
    assert got.token_ids == want.token_ids and got_cycles == want_cycles
    assert chosen == chosen_deferring and chosen[0] > 0 and chosen[1] > 0  # both drafters' proposals were used
    assert forwards < all_forwards  # the cycles that took lookup's drafts ran no block


def test_dflash2_defers_too_and_changes_no_token(tmp_path):
    want, want_cycles, _, _ = _run(_graph(tmp_path / "plain.yaml", defer=False, drafter="dflash2"))
    got, got_cycles, _, _ = _run(_graph(tmp_path / "defer.yaml", defer=True, drafter="dflash2"))
    assert got.token_ids == want.token_ids and got_cycles == want_cycles


def test_defer_min_below_one_is_one_line_naming_the_node(tmp_path):
    graph = _graph(tmp_path / "g.yaml", defer=True, defer_min=0)
    r = run_cli(["check", str(graph)], cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    line = [ln for ln in r.stderr.splitlines() if "parameter 'defer_min'" in ln]
    assert len(line) == 1 and "node 'drafter'" in line[0] and "set defer_min to 1 or more" in line[0], r.stderr


def test_the_cli_runs_a_deferring_graph_with_target_only_tokens(tmp_path):
    graph = _graph(tmp_path / "g.yaml", defer=True)
    r = run_cli(["generate", "--graph", str(graph), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens",
                 "24", "--json", "--ignore-eos", "--compare"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["compare"]["identical"] is True and out["stats"]["accepted"] > 0


def _mixer_min_tokens(graph, value: int):
    data = yaml.safe_load(graph.read_text())
    data["nodes"]["mix"]["params"]["min_tokens"] = value
    graph.write_text(yaml.safe_dump(data))
    return graph


def test_defer_min_below_the_mixers_min_tokens_is_a_check_problem(tmp_path):
    """defer_min 2 beside min_tokens 3: cycles where lookup offers 2 drafts would verify none; one line, the fix."""
    graph = _mixer_min_tokens(_graph(tmp_path / "g.yaml", defer=True), 3)
    r = run_cli(["check", str(graph)], cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    line = [ln for ln in (r.stdout + r.stderr).splitlines() if "[dflash-defer]" in ln]
    assert len(line) == 1 and "node 'drafter'" in line[0] and "offers 2 drafts" in line[0], r.stdout + r.stderr
    assert "fix: set nodes.drafter.params.defer_min=3 (or nodes.mix.params.min_tokens=2)" in line[0]
    assert run_cli(["check", str(graph), "--set", "nodes.drafter.params.defer_min=3"], cwd=tmp_path).returncode == 0


def test_dflash2_defer_min_above_the_mixers_min_tokens_is_a_check_problem(tmp_path):
    """defer_min 4 beside min_tokens 2: the block drafted when lookup offers 2-3 drafts is thrown away."""
    graph = _graph(tmp_path / "g.yaml", defer=True, drafter="dflash2", defer_min=4)
    r = run_cli(["generate", "--graph", str(graph), "--prompt-ids", "3,4,5"], cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "[dflash2-defer]: defer_min 4 drafts in cycles where 'lookup' offers 2-3 drafts" in r.stderr, r.stderr
    no_edge = _graph(tmp_path / "plain.yaml", defer=False, drafter="dflash2", defer_min=4)  # no defer input: no rule
    assert run_cli(["check", str(no_edge)], cwd=tmp_path).returncode == 0


def test_deferring_to_a_proposal_that_feeds_nothing_else_is_a_check_problem(tmp_path):
    """lookup wired only into `defer` (its drafts never verified): one line naming the edge and both fixes."""
    graph = _graph(tmp_path / "g.yaml", defer=True)
    data = yaml.safe_load(graph.read_text())
    data["nodes"].pop("mix")
    data["edges"] = ["drafter.proposal -> target.proposal", "drafter.proposal -> verify.proposal",
                     "lookup.proposal -> drafter.defer"]
    graph.write_text(yaml.safe_dump(data))
    r = run_cli(["check", str(graph)], cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    line = [ln for ln in (r.stdout + r.stderr).splitlines() if "[dflash-defer]" in ln]
    assert len(line) == 1 and "defers to lookup.proposal, which feeds nothing else" in line[0], r.stdout + r.stderr
    assert "drop the edge lookup.proposal -> drafter.defer" in line[0]
