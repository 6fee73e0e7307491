"""Static checks: every rule has a broken fixture, matched by message text."""

from __future__ import annotations

import pytest
from helpers import FIXTURES

from draftflow.core.errors import CheckError
from draftflow.core.plan import build_plan
from draftflow.core.spec import load_graph


def problems(registry, fixture, *overrides):
    plan = build_plan(load_graph(FIXTURES / fixture, list(overrides)), registry)
    return plan, [p.render() for p in plan.problems]


def test_good_graph_has_no_problems_and_auto_wires(registry):
    """A valid graph passes; single producers are auto-wired; the order is topological."""
    plan, found = problems(registry, "good_toy.yaml")
    assert found == []
    rendered = sorted(e.render() for e in plan.edges)
    assert rendered == ["drafter.proposal -> target.proposal", "drafter.proposal -> verify.proposal",
                        "target.features -> drafter.features (carried)", "target.logits -> verify.logits"]
    assert plan.order == ["drafter", "target", "verify"]


@pytest.mark.parametrize("fixture, rule, text", [
    ("unknown_plugin.yaml", "unknown-plugin", "no node type 'toy-targte' is registered; fix: did you mean 'toy-target'?"),
    ("bad_param.yaml", "param", "parameter 'vocab': expected an integer, got 'thirty-two'"),
    ("bad_param.yaml", "param", "unknown parameter 'kv_mod'; fix: remove it or rename it; did you mean 'kv_mode'?"),
    ("bad_edge_port.yaml", "edge", "node has no output port 'proposals'; fix: did you mean 'proposal'?"),
    ("port_type_mismatch.yaml", "port-type", "joins a 'features' output to a 'logits' input"),
    ("missing_producer.yaml", "missing-producer", "required input verify.logits (logits) has no producer"),
    ("missing_producer.yaml", "role", "the graph has no target"),
    ("duplicate_producer.yaml", "duplicate-producer", "input verify.proposal (proposal) could be fed by a.proposal and b.proposal; fix: keep one edge into verify.proposal, or combine the drafters with a mixer node"),
    ("duplicate_explicit.yaml", "duplicate-producer", "input verify.proposal is fed by both a.proposal and b.proposal"),
    ("cyclic.yaml", "cycle", "non-carried edges form a cycle"),
    ("buffer_two_owners.yaml", "buffer-owner", "buffer 'toy_kv' is also owned by 'target'"),
    ("buffer_two_owners.yaml", "role", "a second target (the first is 'target')"),
    ("buffer_non_owner_write.yaml", "buffer-write", "writes buffer 'toy_kv', which is owned by 'target'"),
    ("buffer_non_owner_write.yaml", "buffer-missing", "reads buffer 'ghost', which no node owns"),
    ("incompatible.yaml", "incompatible", "cannot run with 'target', which provides 'kv.grow': the toy drafter reads the KV buffer at fixed addresses"),
    ("capability.yaml", "capability", "requires capability 'target.moe_experts', which no node in the graph provides"),
    ("vram_over.yaml", "vram", "weights and scratch need 1.91 MiB but vram_budget is 1.00 MiB"),
    ("kv_too_small.yaml", "vram", "the KV cache fits only 12 tokens in the 100 B left of vram_budget, 256 needed"),
])
def test_each_rule_reports_node_rule_and_fix(registry, fixture, rule, text):
    """Each broken fixture yields a problem naming node, plugin, rule and fix."""
    _, found = problems(registry, fixture)
    hits = [p for p in found if f"[{rule}]" in p and text in p]
    assert hits, f"no [{rule}] problem containing {text!r} in:\n" + "\n".join(found)
    assert all("fix: " in p for p in found)


def test_problem_lines_carry_file_position_and_plugin(registry):
    """Problem lines start with file:line:col and name the node's plugin."""
    _, found = problems(registry, "incompatible.yaml")
    assert any(p.startswith(str(FIXTURES / "incompatible.yaml") + ":4:3: node 'drafter' (toy-drafter) [incompatible]") for p in found), found


def test_all_problems_reported_at_once_and_sorted(registry):
    """Independent problems are all collected, sorted by node, into one CheckError."""
    plan, found = problems(registry, "many_problems.yaml")
    rules = [p.rule for p in plan.problems]
    assert {"unknown-plugin", "incompatible", "capability"} <= set(rules)
    assert [p.node for p in plan.problems] == sorted(p.node for p in plan.problems)
    with pytest.raises(CheckError, match=r"^\d+ problems in .*many_problems\.yaml:\n") as info:
        plan.raise_if_problems()
    assert str(info.value).count("\n") == len(found)


def test_incompatibility_declared_on_either_side(registry):
    """An incompatibility is found whichever node declares it (here the drafter forbids the target's mode)."""
    _, ok = problems(registry, "incompatible.yaml", "nodes.target.kv_mode=static")
    assert ok == []


def test_carried_edge_breaks_cycle(registry):
    """Marking the feature edge as carried removes the cycle."""
    from draftflow.core.spec import graph_from_text

    text = (FIXTURES / "cyclic.yaml").read_text().replace("drafter.features\n", "drafter.features (carried)\n")
    plan = build_plan(graph_from_text(text, "cyclic-fixed.yaml"), registry)
    assert plan.problems == []


def test_kv_cache_autosizes_to_budget(registry):
    """With a budget, the KV capacity is what is left after weights, capped by the context limit."""
    plan, found = problems(registry, "good_toy.yaml", "vram_budget=10000", "nodes.target.weights_bytes=4000", "nodes.target.context=100000")
    assert found == []
    assert plan.vram.kv_tokens == (10000 - 4000) // 8 and plan.vram.kv_limit_reason == "vram_budget"
    plan, _ = problems(registry, "good_toy.yaml", "vram_budget=1GiB", "nodes.target.context=300")
    assert plan.vram.kv_tokens == 300 and plan.vram.kv_limit_reason == "model context limit"


def test_plugin_check_hook_adds_problems(registry):
    """A check registered through draftflow_add_checks runs and its problems are reported."""
    from draftflow.core.problems import Problem

    registry.add_check("no-drafter-named-a", lambda plan: [Problem("a", "naming", "do not call a drafter 'a'", "rename it")] if "a" in plan.nodes else [])
    _, found = problems(registry, "duplicate_producer.yaml")
    assert any("[naming]: do not call a drafter 'a'; fix: rename it" in p for p in found)


def test_crashing_check_is_reported_not_raised(registry):
    """A check that raises becomes a problem naming it instead of a traceback."""
    registry.add_check("broken", lambda plan: 1 / 0)
    _, found = problems(registry, "good_toy.yaml")
    assert any("[check-crashed]: check 'broken'" in p and "ZeroDivisionError" in p for p in found)


def test_every_role_has_a_schedule_rank_and_a_drawing_colour():
    from draftflow.core.manifest import ROLES
    from draftflow.core.plan import ROLE_RANK
    from draftflow.core.report import ROLE_COLORS

    assert set(ROLE_RANK) == set(ROLES) == set(ROLE_COLORS)
