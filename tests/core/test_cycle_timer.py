"""`CycleTimer` (core/request.py): a cycle of N nodes records N + 1 CUDA events, each on the current stream of the
executor's own device named by index, and every node's interval runs from the previous node's end mark."""

from __future__ import annotations

import torch

from draftflow.core import request


class FakeEvent:
    recorded: list = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at = None

    def record(self, stream):
        self.at = len(FakeEvent.recorded)
        FakeEvent.recorded.append(stream)

    def elapsed_time(self, end) -> float:
        return float(end.at - self.at)  # one "millisecond" per event recorded in between


def test_nodes_share_their_boundary_events(monkeypatch):
    FakeEvent.recorded = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    timer = request.CycleTimer(torch.device("cuda", 1))
    mark = timer.start()
    for role in ("drafter", "target", "verifier"):
        mark = timer.stop(role, mark)
    assert FakeEvent.recorded == [("stream of", 1)] * 4  # 3 nodes, 4 events, all on cuda:1's current stream
    assert timer.totals_ms() == {"drafter": 1.0, "target": 1.0, "verifier": 1.0} and timer.marks == []


def test_cpu_intervals_chain_too():
    timer = request.CycleTimer(torch.device("cpu"))
    first = timer.start()
    middle = timer.stop("drafter", first)
    last = timer.stop("target", middle)
    assert first <= middle <= last and [m[1:] for m in timer.marks] == [(first, middle), (middle, last)]
