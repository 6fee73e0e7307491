"""The executor's step API: start / step / finish, the events it emits, warm-up and cold-start stats."""

from __future__ import annotations

import pytest
import toy_plugins
from helpers import FIXTURES

from draftflow.core.errors import OwnershipError
from draftflow.core.executor import CycleResult, Executor
from draftflow.core.hookspecs import hookimpl
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.session import Session
from draftflow.core.spec import load_graph
from draftflow.core.tracing import REQUEST_FIELDS


class Recorder:
    """A trace sink that keeps every event; ``fail_at`` makes it raise on that cycle (once)."""

    def __init__(self, fail_at: int | None = None):
        self.cycles, self.done, self.fail_at = [], [], fail_at

    @hookimpl
    def draftflow_cycle_event(self, event):
        self.cycles.append(dict(event))
        if event["cycle"] == self.fail_at:
            self.fail_at = None
            raise RuntimeError("sink failed")

    @hookimpl
    def draftflow_request_event(self, event):
        self.done.append(dict(event))


def executor(registry, *overrides, sink=None, fixture="good_toy.yaml"):
    if sink is not None:
        registry.pm.register(sink)
    return Executor(build_plan(load_graph(FIXTURES / fixture, list(overrides)), registry), hook=registry.pm.hook)


def run_steps(ex, prompt, sampling, request_id="r"):
    state = ex.start(prompt, sampling, request_id)
    cycles = []
    while not cycles or cycles[-1].finish is None:
        cycles.extend(ex.step([state]))
    return state, cycles


@pytest.mark.parametrize("overrides, sampling", [
    ((), SamplingParams(max_new_tokens=25)),
    (("nodes.drafter.wrong_at=[0]",), SamplingParams(max_new_tokens=9)),
    (("num_draft=6", "nodes.drafter.wrong_at=[]"), SamplingParams(max_new_tokens=20, temperature=0.7, seed=3)),
])
def test_steps_equal_generate(registry, overrides, sampling):
    """start/step/finish gives generate's tokens, finish reason and statistics, one CycleResult per step."""
    reference = executor(registry, *overrides).generate([1, 2, 3], sampling)
    ex = executor(registry, *overrides)
    state, cycles = run_steps(ex, [1, 2, 3], sampling)
    result = ex.finish(state)
    assert result.token_ids == reference.token_ids and result.finish_reason == reference.finish_reason == "length"
    same = ("cycles", "drafted", "accepted", "tau", "acceptance_rate", "per_position_acceptance")
    assert {k: result.stats[k] for k in same} == {k: reference.stats[k] for k in same}
    assert all(isinstance(c, CycleResult) for c in cycles) and len(cycles) == result.stats["cycles"]
    assert [c.cycle for c in cycles] == list(range(len(cycles)))
    assert [c.finish for c in cycles] == [None] * (len(cycles) - 1) + ["length"]
    assert [t for c in cycles for t in c.emitted] == list(result.token_ids)
    for a, b in zip(cycles, cycles[1:]):
        assert b.position == a.position + len(a.emitted) and b.anchor == a.emitted[-1]


def test_finish_reasons(registry):
    """EOS and a request stop token end with "stop" on the cycle that emitted them; the token is kept."""
    ref = toy_plugins.reference([1, 2, 3], 20, 32)
    ex = executor(registry, f"nodes.target.eos=[{ref[4]}]", "num_draft=6", "nodes.drafter.wrong_at=[]")
    state, cycles = run_steps(ex, [1, 2, 3], SamplingParams(max_new_tokens=20))
    assert cycles[-1].finish == "stop" and cycles[-1].emitted[-1] == ref[4]
    result = ex.finish(state)
    assert list(result.token_ids) == ref[:5] and result.finish_reason == "stop"
    state, cycles = run_steps(ex, [1, 2, 3], SamplingParams(max_new_tokens=20, stop_token_ids=(ref[2],), ignore_eos=True))
    assert ex.finish(state).token_ids == tuple(ref[:3]) and cycles[-1].finish == "stop"


def test_events_are_the_cycle_results(registry):
    """A sink sees each CycleResult's event exactly once, then one request_done with every documented field."""
    sink = Recorder()
    ex = executor(registry, sink=sink)
    state, cycles = run_steps(ex, [1, 2, 3], SamplingParams(max_new_tokens=12), request_id="req-7")
    assert sink.done == []  # request_done comes from finish, not from the last step
    result = ex.finish(state)
    assert sink.cycles == [c.event() for c in cycles]
    assert [d["request_id"] for d in sink.done] == ["req-7"] and set(sink.done[0]) == set(REQUEST_FIELDS)
    assert sink.done[0]["tokens"] == 12 and sink.done[0]["finish_reason"] == "length"
    assert {k: sink.done[0][k] for k in result.stats} == result.stats


def test_finish_early_with_a_reason_and_kept_tokens(registry):
    """finish(state, reason, kept) ends a running request: its Result and request_done count the kept tokens."""
    sink = Recorder()
    ex = executor(registry, sink=sink)
    state = ex.start([1, 2, 3], SamplingParams(max_new_tokens=40))
    with pytest.raises(ValueError, match="has not finished; step it until"):
        ex.finish(state)
    ex.step([state])
    ex.step([state])
    generated = len(state.generated)
    result = ex.finish(state, "cancelled", kept=generated - 1)
    assert result.finish_reason == "cancelled" and list(result.token_ids) == toy_plugins.reference([1, 2, 3], generated - 1, 32)
    assert result.stats["cycles"] == 2 and sink.done[-1]["tokens"] == generated - 1
    assert sink.done[-1]["finish_reason"] == "cancelled"
    with pytest.raises(ValueError, match="has finished \\(cancelled\\); start a new one"):
        ex.step([state])


def test_request_slots(registry):
    """A start takes a free slot (none free: refused); the same state twice is refused; finish frees the slot."""
    ex = executor(registry)
    assert ex.max_batch == 1 and ex.free_slots == 1
    old = ex.start([1, 2, 3], SamplingParams(max_new_tokens=30))
    ex.step([old])
    with pytest.raises(ValueError, match="the same request twice"):
        ex.step([old, old])
    with pytest.raises(RuntimeError, match="all 1 request slots are busy"):
        ex.start([5], SamplingParams(max_new_tokens=10))
    ex.finish(old, "cancelled")
    assert ex.free_slots == 1 and ex.live() == []
    new, _ = run_steps(ex, [5], SamplingParams(max_new_tokens=10))
    assert list(ex.finish(new).token_ids) == toy_plugins.reference([5], 10, 32)  # the nodes re-prefilled the slot


def test_requests_step_together_and_join_between_cycles(registry):
    """With max_batch 3, requests started at different cycles step in one batch and each gets its own tokens."""
    ex = executor(registry, "max_batch=3")
    prompts = {"a": [1, 2, 3], "b": [5], "c": [7, 8]}
    budgets = {"a": 25, "b": 9, "c": 17}
    states = {"a": ex.start(prompts["a"], SamplingParams(max_new_tokens=25), "a")}
    results = {}
    cycle = 0
    while states:
        if cycle == 2:
            states["b"] = ex.start(prompts["b"], SamplingParams(max_new_tokens=9), "b")
        if cycle == 3:
            states["c"] = ex.start(prompts["c"], SamplingParams(max_new_tokens=17), "c")
        done = ex.step(list(states.values()))
        assert all(r.batch == len(states) for r in done)
        for r in done:
            if r.finish is not None:
                results[r.request_id] = ex.finish(states.pop(r.request_id))
        cycle += 1
    assert ex.free_slots == 3
    for rid, prompt in prompts.items():
        assert list(results[rid].token_ids) == toy_plugins.reference(prompt, budgets[rid], 32)


def test_failed_step_ends_the_request(registry):
    """A node error inside a cycle propagates; that state can no longer step, and a new start runs exactly."""
    ex = executor(registry, "nodes.drafter.scribble=true", "nodes.drafter.reads=[toy_kv]")
    ex.debug = True
    state = ex.start([1, 2, 3], SamplingParams(max_new_tokens=5))
    with pytest.raises(OwnershipError, match="wrote buffer 'toy_kv'"):
        ex.step([state])
    with pytest.raises(ValueError, match="a cycle failed after it started"):
        ex.step([state])
    ex.debug = False
    assert list(ex.generate([1, 2, 3], SamplingParams(max_new_tokens=5)).token_ids) == toy_plugins.reference([1, 2, 3], 5, 32)


def test_raising_sink_propagates_without_corrupting_the_request(registry):
    """A sink that raises is an error for the caller, raised after the cycle committed: stepping on stays exact."""
    sink = Recorder(fail_at=1)
    ex = executor(registry, sink=sink)
    state = ex.start([1, 2, 3], SamplingParams(max_new_tokens=20))
    ex.step([state])
    with pytest.raises(RuntimeError, match="sink failed"):
        ex.step([state])
    assert state.cycle == 2 and state.stats.cycles == 2
    while state.finish_reason is None:
        ex.step([state])
    result = ex.finish(state)
    assert list(result.token_ids) == toy_plugins.reference([1, 2, 3], 20, 32)
    assert [e["cycle"] for e in sink.cycles] == list(range(result.stats["cycles"]))
    sink.fail_at = 0
    with pytest.raises(RuntimeError, match="sink failed"):  # generate does not swallow it either
        ex.generate([1, 2, 3], SamplingParams(max_new_tokens=5))


def test_session_warms_every_node_once_before_requests(registry, monkeypatch):
    """Session.open calls Node.warmup on each node once, target first, and reports load_s / warmup_s per request."""
    calls = []
    for cls in (toy_plugins.ToyTarget, toy_plugins.ToyDrafter):
        monkeypatch.setattr(cls, "warmup", lambda self: calls.append(self.name))
    session = Session.open(graph_path=FIXTURES / "good_toy.yaml", registry=registry)
    try:
        assert calls == ["target", "drafter"]
        ex = session.executor
        assert ex.load_s > 0 and ex.warmup_s is not None and ex.warmup() == ex.warmup_s and calls == ["target", "drafter"]
        stats = session.generate([1, 2, 3], SamplingParams(max_new_tokens=8)).stats
        assert stats["load_s"] == ex.load_s and stats["warmup_s"] == ex.warmup_s
        assert 0 < stats["prefill_ms"] < stats["ttft_s"] * 1000
    finally:
        session.close()
