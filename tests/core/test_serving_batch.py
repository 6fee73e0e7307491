"""The serve worker batches: requests share cycles, leave and join between them, and get exactly their own tokens.

In process, over the toy graph (tests/toy_plugins.py: a deterministic target whose greedy output
is ``reference(prompt)``), with token ids as text so every delta can be checked.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import toy_plugins

from draftflow.core.node import SamplingParams
from draftflow.core.serving import Engine, ServeRequest
from draftflow.core.session import Session

VOCAB = 32


def toy_graph(max_batch: int) -> dict:
    return {"name": "toy", "num_draft": 3, "max_batch": max_batch,
            "nodes": {"target": {"plugin": "toy-target", "params": {"vocab": VOCAB}},
                      "drafter": {"plugin": "toy-drafter", "params": {"wrong_at": [2]}},
                      "verify": {"plugin": "verifier"}}}


def as_text(ids) -> str:
    return "".join(f"{i} " for i in ids)


def expected(req: ServeRequest, n: int | None = None) -> str:
    return as_text(toy_plugins.reference(req.prompt_ids, n or req.sampling.max_new_tokens, VOCAB))


class Steps:
    """Wraps Executor.step: records the request ids of every cycle; ``on_cycle(i)`` runs after cycle i."""

    def __init__(self, executor, on_cycle=None):
        self.step, self.cycles, self.on_cycle = executor.step, [], on_cycle
        executor.step = self

    def __call__(self, states):
        out = self.step(states)
        self.cycles.append([s.request_id for s in states])
        if self.on_cycle is not None:
            self.on_cycle(len(self.cycles) - 1)
        return out


@pytest.fixture
def engine_of(registry):
    """engine_of(max_batch) -> a started Engine over the toy graph; closed after the test."""
    opened = []

    def make(max_batch: int, **kwargs) -> Engine:
        session = Session.open(graph_dict=toy_graph(max_batch), registry=registry)
        engine = Engine(session, decode=as_text, **kwargs)
        opened.append((engine, session))
        return engine

    yield make
    for engine, session in opened:
        engine.close()
        session.close()


def collect(req: ServeRequest, timeout: float = 30) -> tuple[dict[int, str], list]:
    """Read a request's events to its end: (text per choice index, the finish/error events)."""
    texts, ends = {}, []
    while True:
        event = req.events.get(timeout=timeout)
        if event[0] == "delta":
            texts[event[1]] = texts.get(event[1], "") + event[2]
            continue
        ends.append(event)
        if event[0] == "error" or event[3] is not None:
            return texts, ends


def request(name: str, prompt, max_tokens: int, client: str = "c", **kwargs) -> ServeRequest:
    return ServeRequest(name, list(prompt), SamplingParams(max_new_tokens=max_tokens, ignore_eos=True), client=client,
                        **kwargs)


def metric(engine: Engine, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)} (\S+)$", engine.metrics.render(), re.MULTILINE).group(1))


def test_concurrent_requests_batch_and_match_alone(engine_of):
    """12 greedy requests of different prompts and lengths over 4 slots each get exactly their alone output;
    cycles step up to 4 requests at once and never more."""
    engine = engine_of(4)
    steps = Steps(engine.executor)
    reqs = [request(f"r{i}", [i + 1, 2 * i + 3], 3 + 5 * i, client=f"c{i % 3}") for i in range(12)]
    for r in reqs:
        engine.submit(r)
    for r in reqs:
        texts, ends = collect(r)
        assert texts[0] == expected(r) and ends[-1][2] == "length", r.id
    widths = [len(c) for c in steps.cycles]
    assert max(widths) == 4 and all(len(set(c)) == len(c) for c in steps.cycles)
    assert metric(engine, 'draftflow_batch_size_per_cycle_bucket{le="1"}') < metric(engine, "draftflow_batch_size_per_cycle_count")
    assert metric(engine, "draftflow_batch_slots") == 4 and metric(engine, 'draftflow_requests_total{finish_reason="length"}') == 12


def test_cancel_frees_the_slot_within_one_cycle(engine_of):
    """A request cancelled during cycle 2 is not stepped again: its slot goes to the waiting request in the next
    cycle, and the request still running is unaffected."""
    engine = engine_of(2, start=False)
    a, b, c = request("a", [1, 2], 500), request("b", [5, 6], 40), request("c", [7, 8], 10)
    steps = Steps(engine.executor, on_cycle=lambda i: engine.cancel(a) if i == 2 else None)
    for r in (a, b, c):
        engine.submit(r)
    engine.start()
    text_a, ends_a = collect(a)
    assert ends_a[-1][2] == "cancelled" and ends_a[-1][3]["stats"]["cycles"] == 3
    assert text_a[0] == expected(a, ends_a[-1][3]["completion_tokens"])
    for r in (b, c):
        texts, ends = collect(r)
        assert texts[0] == expected(r) and ends[-1][2] == "length"
    assert steps.cycles[:3] == [["a", "b"]] * 3 and steps.cycles[3] == ["b", "c"]
    assert metric(engine, 'draftflow_requests_total{finish_reason="cancelled"}') == 1


def test_n_choices_run_side_by_side(engine_of):
    """n = 3 choices take three slots of one cycle; the finish carrying usage comes last, after every choice's text."""
    engine = engine_of(4)
    steps = Steps(engine.executor)
    req = request("n3", [3, 4], 6, n=3, best_of=3)
    engine.submit(req)
    texts, ends = collect(req)
    assert texts == {i: expected(req) for i in range(3)}
    assert sorted(e[1] for e in ends) == [0, 1, 2] and ends[-1][3]["completion_tokens"] == 18
    assert steps.cycles[0] == ["n3", "n3-1", "n3-2"]


def test_failed_cycle_fails_its_requests_then_serves_on(engine_of):
    """A cycle that raises answers every request in it with a 500 and frees their slots; the next requests are exact."""
    engine = engine_of(2, start=False)
    a, b = request("a", [1, 2], 30), request("b", [3, 4], 30)
    real = engine.executor.step

    def broken(states):
        if len(states) == 2:
            raise RuntimeError("boom in step")
        return real(states)

    engine.executor.step = broken
    for r in (a, b):
        engine.submit(r)
    engine.start()
    for r in (a, b):
        _, ends = collect(r)
        assert ends == [("error", 500, "internal error while generating: RuntimeError: boom in step")]
    engine.executor.step = real
    c = request("c", [9, 9], 12)
    engine.submit(c)
    texts, ends = collect(c)
    assert texts[0] == expected(c) and engine.executor.free_slots == 2


def test_fair_admission_across_clients(engine_of):
    """With one slot, a client's burst of three alternates with another client's single request (round-robin)."""
    engine = engine_of(1, start=False)
    steps = Steps(engine.executor)
    reqs = [request(name, [1, 2], 2, client=name[0]) for name in ("a1", "a2", "a3", "b1")]
    for r in reqs:
        engine.submit(r)
    engine.start()
    for r in reqs:
        collect(r)
    order = list(dict.fromkeys(rid for cycle in steps.cycles for rid in cycle))
    assert order == ["a1", "b1", "a2", "a3"]


def test_close_ends_running_requests_as_cancelled(engine_of):
    """Closing the engine ends the requests in flight as cancelled (their text so far kept) and the waiting ones 503."""
    engine = engine_of(1)
    started = threading.Event()
    Steps(engine.executor, on_cycle=lambda i: (started.set(), time.sleep(0.02)))  # slow: it is still running at close
    running, waiting = request("run", [1, 2], 500), request("wait", [3, 4], 5)
    engine.submit(running)
    started.wait(10)
    engine.submit(waiting)
    engine.close()
    assert collect(running)[1][-1][2] == "cancelled"
    assert collect(waiting)[1] == [("error", 503, "the server is shutting down")]


def test_a_long_prompt_joins_in_chunks_while_others_decode(engine_of):
    """With prefill_budget 8, a 40-token prompt that arrives during a run is prefilled over 5 loops, one chunk
    between two cycles of the running request, and then joins its batch; both get exactly their tokens."""
    engine = engine_of(2, start=False, prefill_budget=8)
    short, long = request("short", [1, 2], 60), request("long", [i % 31 + 1 for i in range(40)], 12)
    prefills = []
    step = engine.executor.prefill_step

    def recording(state, budget=None):
        used = step(state, budget)
        prefills.append((len(steps.cycles), used, state.ready))
        return used

    engine.executor.prefill_step = recording
    steps = Steps(engine.executor, on_cycle=lambda i: engine.submit(long) if i == 1 else None)
    engine.submit(short)
    engine.start()
    for r in (short, long):
        texts, ends = collect(r)
        assert texts[0] == expected(r) and ends[-1][2] == "length"
    chunks = [p for p in prefills if p[0] >= 2]  # the long prompt's, taken while "short" decodes
    assert [used for _, used, _ in chunks] == [8, 8, 8, 8, 7] and chunks[-1][2]
    assert [c for c, _, _ in chunks] == list(range(chunks[0][0], chunks[0][0] + 5))  # one chunk per cycle
    joined = next(i for i, ids in enumerate(steps.cycles) if "long" in ids)
    assert all(steps.cycles[i] == ["short"] for i in range(2, joined)) and joined >= 6
