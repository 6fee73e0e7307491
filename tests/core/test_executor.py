"""The executor: schedule from the graph, carried values, commits, ownership, limits."""

from __future__ import annotations

import pytest
import toy_plugins
from helpers import FIXTURES

from draftflow.core.errors import OwnershipError, RequestError
from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.spec import load_graph


def executor(registry, *overrides, fixture="good_toy.yaml", debug=None):
    plan = build_plan(load_graph(FIXTURES / fixture, list(overrides)), registry)
    return Executor(plan, hook=registry.pm.hook, debug=debug)


@pytest.mark.parametrize("wrong_at", [[], [0], [1], [0, 1, 2]])
def test_output_equals_target_rule_whatever_the_drafts(registry, wrong_at):
    """Greedy output equals the target's own continuation for full, partial and zero acceptance."""
    ex = executor(registry, f"nodes.drafter.wrong_at={wrong_at}")
    result = ex.generate([1, 2, 3], SamplingParams(max_new_tokens=25))
    assert list(result.token_ids) == toy_plugins.reference([1, 2, 3], 25, 32)
    assert result.finish_reason == "length"
    expected_rate = {(): 1.0, (0,): 0.0}.get(tuple(wrong_at))
    if expected_rate is not None:
        assert result.stats["acceptance_rate"] == expected_rate


def test_carried_features_arrive_next_cycle(registry):
    """The drafter sees prefill features in cycle 0 and the previous commit's features afterwards."""
    ex = executor(registry)
    ex.generate([1, 2, 3], SamplingParams(max_new_tokens=10))
    seen = ex.nodes["drafter"].features_seen
    assert seen[0] == (0, 2)  # prompt minus the anchor
    assert seen[1] == (2, 3)  # cycle 0 anchor position 2, two drafts accepted + anchor


def test_schedule_comes_from_graph(registry):
    """The per-cycle order is the topological order of the non-carried edges."""
    ex = executor(registry)
    assert ex.order == ["drafter", "target", "verify"]


def test_target_only_graph(registry):
    """Without a drafter the same executor decodes one token per cycle."""
    ex = executor(registry, fixture="base.yaml")
    result = ex.generate([5], SamplingParams(max_new_tokens=6))
    assert list(result.token_ids) == toy_plugins.reference([5], 6, 32)
    assert result.stats["cycles"] == 6 and result.stats["drafted"] == 0


def test_eos_inside_accepted_run_truncates(registry):
    """An EOS among accepted drafts ends the output right after the EOS."""
    ref = toy_plugins.reference([1, 2, 3], 20, 32)
    eos = ref[4]
    ex = executor(registry, f"nodes.target.eos=[{eos}]", "num_draft=6")
    result = ex.generate([1, 2, 3], SamplingParams(max_new_tokens=20))
    assert list(result.token_ids) == ref[:5] and result.finish_reason == "stop"


def test_max_new_tokens_respected_mid_window(registry):
    """max_new_tokens cuts inside a window; drafts never go past it."""
    ex = executor(registry, "num_draft=8", "nodes.drafter.wrong_at=[]")
    result = ex.generate([1], SamplingParams(max_new_tokens=5))
    assert len(result.token_ids) == 5 and result.stats["drafted"] == 4 and result.stats["cycles"] == 1


def test_prompt_past_context_is_an_error(registry):
    """prompt + max_new_tokens beyond the KV capacity is a RequestError naming both numbers."""
    ex = executor(registry, "nodes.target.context=300")
    with pytest.raises(RequestError, match=r"prompt \(3 tokens\) \+ max_new_tokens \(400\) = 403 exceeds the context of 300 tokens"):
        ex.generate([1, 2, 3], SamplingParams(max_new_tokens=400))


def test_token_outside_vocab_is_an_error(registry):
    """A prompt id outside the vocabulary is rejected before any step."""
    with pytest.raises(RequestError, match=r"prompt token id 99 is outside the vocabulary \[0, 32\)"):
        executor(registry).generate([1, 99], SamplingParams(max_new_tokens=3))


def test_debug_mode_catches_write_to_foreign_buffer(registry):
    """In debug mode a node that bumps another node's buffer version is named."""
    ex = executor(registry, "nodes.drafter.scribble=true", "nodes.drafter.reads=[toy_kv]", debug=True)
    with pytest.raises(OwnershipError, match="node 'drafter' \\(toy-drafter\\) wrote buffer 'toy_kv', which is owned by 'target'"):
        ex.generate([1, 2, 3], SamplingParams(max_new_tokens=5))
    quiet = executor(registry, "nodes.drafter.scribble=true", "nodes.drafter.reads=[toy_kv]", debug=False)
    quiet.generate([1, 2, 3], SamplingParams(max_new_tokens=5))


def test_memory_over_estimate_warns(registry):
    """A node using more than 10% over its declared memory produces a warning naming it."""
    ex = executor(registry, "nodes.target.hidden_bytes=8000000")
    assert len(ex.warnings) == 1 and "node 'target' (toy-target)" in ex.warnings[0]
    ok = executor(registry, "nodes.target.hidden_bytes=8000000", "nodes.target.weights_bytes=8000000")
    assert ok.warnings == []
