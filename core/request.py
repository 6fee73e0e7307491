"""A request as the executor runs it: the step API's types and the cycle timer.

``ActiveRequest`` is what ``Executor.start`` returns and ``step`` advances (the nodes'
``RequestState`` plus what the executor carries between cycles), ``CycleResult`` what one
cycle did for one request, ``Result`` what ``finish`` returns.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import torch

from draftflow.core.node import RequestState, SamplingParams
from draftflow.core.tracing import RequestStats


def active_processors(sampling: SamplingParams) -> tuple[str, ...]:
    """Names of the logit processors a request turns on, in the order they run (the trace's ``processors``)."""
    names = (("repetition", sampling.repetition_penalty != 1.0), ("presence", bool(sampling.presence_penalty)),
             ("frequency", bool(sampling.frequency_penalty)), ("logit_bias", bool(sampling.logit_bias)),
             ("grammar", sampling.grammar is not None), ("min_p", bool(sampling.min_p)))
    return tuple(name for name, on in names if on)


@attrs.frozen
class TokenLogprob:
    """One emitted token's logprob under the target's processed distribution, and the ``top`` alternatives.

    ``top`` holds (token id, logprob) pairs, likeliest first; it is empty when the request asked
    for ``logprobs=0`` (the chosen token only).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class Result:
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    finish_reason: str
    stats: dict
    text: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token in token_ids; None unless asked for


@attrs.define(eq=False)
class ActiveRequest(RequestState):
    """A request the executor is running: what the nodes see (``RequestState``) plus what it carries between steps."""

    stops: frozenset[int] = frozenset()  # EOS (unless ignore_eos) and the request's stop token ids
    started: float = 0.0  # perf_counter at start
    carried: dict[tuple[str, str], Any] = attrs.field(factory=dict)  # (node, port) -> value for the next cycle
    generated: list[int] = attrs.field(factory=list)  # committed output tokens
    logprobs: list[TokenLogprob] = attrs.field(factory=list)  # one per generated token, when the request asks
    stats: RequestStats = attrs.field(factory=RequestStats)
    prefill_marks: tuple[Any, Any] = (0.0, 0.0)  # timer marks around the prefill, read after a sync
    prefilled: int = 0  # prompt tokens in the nodes' state (start(defer_prefill=True) + prefill_step)
    ready: bool = True  # prefilled: step may take it
    ttft_s: float | None = None  # start to the end of the first cycle
    finish_reason: str | None = None  # "stop" or "length" once a cycle ended it (or finish's reason)
    done: bool = False  # finish() was called


@attrs.frozen
class CycleResult:
    """What one cycle did for one request; ``event()`` is its ``draft_cycle`` trace event (docs/TRACING.md)."""

    request_id: str
    cycle: int  # 0-based within the request
    position: int  # sequence index of the anchor at the start of the cycle
    anchor: int
    draft: tuple[int, ...]  # proposed token ids
    accepted: int  # draft tokens the verifier accepted
    emitted: tuple[int, ...]  # tokens committed, cut after a stop token or at max_new_tokens
    draft_ms: float
    verify_ms: float
    commit_ms: float
    fields: dict = attrs.field(factory=dict)  # node fields (Node.cycle_fields)
    finish: str | None = None  # "stop" or "length" when this cycle ended the request
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per emitted token, when the request asks
    processors: tuple[str, ...] = ()  # the request's active logit processors (active_processors)
    batch: int = 1  # requests stepped together in this cycle (draft_ms and verify_ms are the whole batch's)
    num_draft: int = 0  # the cycle's K: the widest draft any row asked for

    def event(self) -> dict:
        core = {"request_id": self.request_id, "cycle": self.cycle, "position": self.position, "anchor": self.anchor,
                "draft": list(self.draft), "accepted": self.accepted, "emitted": list(self.emitted),
                "draft_ms": self.draft_ms, "verify_ms": self.verify_ms, "commit_ms": self.commit_ms,
                "batch": self.batch, "k": self.num_draft}
        if self.processors:
            core["processors"] = list(self.processors)
        return {**core, **{k: v for k, v in self.fields.items() if k not in core}}  # core fields win a name clash


class CycleTimer:
    """Per-node timings: CUDA events on the GPU (read after the cycle's one sync), perf_counter on CPU.

    A cycle's nodes run back to back, so each node's end mark is the next one's start (`stop`
    returns it): N nodes record N + 1 events, not 2N. Events are recorded on the current stream of
    the executor's own device, named by index (`torch.cuda.current_stream()` without one resolves
    the current device through several Python checks on every call: ~20% of a small model's host
    time per token on the H200 under cProfile, docs/BENCHMARKS.md 2026-12-04).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.index = (device.index if device.index is not None else torch.cuda.current_device()) if self.cuda else None
        self.marks: list[tuple[str, Any, Any]] = []

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.index))
            return ev
        return time.perf_counter()

    def stop(self, role: str, begin):
        """Close `role`'s interval from `begin`; returns the end mark, the next node's start."""
        end = self.start()
        self.marks.append((role, begin, end))
        return end

    def elapsed_ms(self, begin, end) -> float:
        if self.cuda:
            end.synchronize()  # already complete after a cycle's sync; waits only if none ran yet
            return begin.elapsed_time(end)
        return (end - begin) * 1000

    def totals_ms(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, a, b in self.marks:
            ms = a.elapsed_time(b) if self.cuda else (b - a) * 1000
            out[role] = out.get(role, 0.0) + ms
        self.marks.clear()
        return out
