"""Tracing: the draft_cycle / request_done schema, the JSONL sink, trace summarize."""

from __future__ import annotations

import json

import structlog
from helpers import FIXTURES

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.spec import load_graph
from draftflow.core.summarize import read_trace, summarize
from draftflow.core.tracing import CYCLE_FIELDS, REQUEST_FIELDS, JsonlSink


def run(registry, *overrides, sink=None, prompt=(1, 2, 3), n=12):
    if sink is not None:
        registry.pm.register(sink)
    plan = build_plan(load_graph(FIXTURES / "good_toy.yaml", list(overrides)), registry)
    ex = Executor(plan, hook=registry.pm.hook)
    with structlog.testing.capture_logs() as logs:
        result = ex.generate(list(prompt), SamplingParams(max_new_tokens=n), request_id="req-1")
    return result, logs


def test_cycle_event_schema(registry):
    """One draft_cycle event per cycle with exactly the documented fields, then one request_done."""
    result, logs = run(registry)
    cycles = [e for e in logs if e["event"] == "draft_cycle"]
    done = [e for e in logs if e["event"] == "request_done"]
    assert len(cycles) == result.stats["cycles"] and len(done) == 1
    for i, e in enumerate(cycles):
        assert set(e) - {"event", "log_level"} == set(CYCLE_FIELDS)
        assert e["request_id"] == "req-1" and e["cycle"] == i
        assert isinstance(e["draft"], list) and isinstance(e["emitted"], list)
        assert 0 <= e["accepted"] <= len(e["draft"]) and len(e["emitted"]) <= e["accepted"] + 1
        assert e["draft_ms"] >= 0 and e["verify_ms"] > 0
    # position is the anchor's index; the next cycle's anchor is the last emitted token
    for a, b in zip(cycles, cycles[1:]):
        assert b["position"] == a["position"] + len(a["emitted"]) and b["anchor"] == a["emitted"][-1]
    assert cycles[0]["position"] == 2 and cycles[0]["anchor"] == 3
    assert set(done[0]) - {"event", "log_level"} == set(REQUEST_FIELDS)
    emitted = [t for e in cycles for t in e["emitted"]]
    assert emitted == list(result.token_ids)


def test_request_metrics_definitions(registry):
    """tau, acceptance rate and per-position acceptance follow their definitions."""
    result, logs = run(registry, "nodes.drafter.wrong_at=[2]", n=30)
    cycles = [e for e in logs if e["event"] == "draft_cycle"]
    s = result.stats
    assert s["tau"] == round(sum(len(e["emitted"]) for e in cycles) / len(cycles), 4)
    assert s["acceptance_rate"] == round(sum(e["accepted"] for e in cycles) / sum(len(e["draft"]) for e in cycles), 4)
    assert s["per_position_acceptance"][:3] == [1.0, 1.0, 0.0]


def test_jsonl_sink_and_summarize(registry, tmp_path):
    """--trace JSONL holds every event; summarize recomputes the same statistics and plots them."""
    path = tmp_path / "t.jsonl"
    sink = JsonlSink(path)
    result, _ = run(registry, sink=sink, n=20)
    sink.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [l["event"] for l in lines].count("request_done") == 1
    summary = summarize(*read_trace(path))
    assert summary["tau"] == result.stats["tau"] and summary["tokens"] == 20
    assert summary["per_position_acceptance"] == result.stats["per_position_acceptance"]
    assert sum(summary["accept_length_histogram"].values()) == result.stats["cycles"]
    assert summary["mean_prefill_ms"] == result.stats["prefill_ms"] and summary["load_s"] == result.stats["load_s"]
    from draftflow.core.summarize import plot, render

    assert f"(prefill {result.stats['prefill_ms']:.2f} ms)" in render(summary) and "warm-up none" in render(summary)

    plot(summary, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_an_unconfigured_structlog_prints_nothing_but_sinks_get_every_event(registry, capsys, tmp_path):
    """A program that drives the executor without configuring structlog: no log line per cycle on stdout or
    stderr (structlog's unconfigured default would print each one), while a trace sink still gets every event."""
    structlog.reset_defaults()
    path = tmp_path / "t.jsonl"
    sink = JsonlSink(path)
    registry.pm.register(sink)
    plan = build_plan(load_graph(FIXTURES / "good_toy.yaml", []), registry)
    result = Executor(plan, hook=registry.pm.hook).generate([1, 2, 3], SamplingParams(max_new_tokens=12))
    sink.close()
    out, err = capsys.readouterr()
    assert "draft_cycle" not in out + err and "request_done" not in out + err
    events = [json.loads(line)["event"] for line in path.read_text().splitlines()]
    assert events.count("draft_cycle") == result.stats["cycles"] and events.count("request_done") == 1
