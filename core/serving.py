"""Serving: a fair request queue and one worker thread that owns the executor.

The executor runs one request at a time and knows nothing about HTTP. The worker takes
requests from a ``FairQueue`` (round-robin over client keys) and drives the executor's
step API itself: ``start``, then ``step`` one cycle at a time; between cycles it turns the
committed tokens into text deltas for the waiting HTTP handler, looks for stop strings and
checks whether the request was cancelled (client gone, server closing), and ends the
request with ``finish`` (which sends the ``request_done`` event and produces the summary).
A request the worker abandons (an error mid-cycle) is replaced by the next ``start``,
which re-prefills every node, so the executor stays usable.

A request for ``n`` choices (or ``best_of`` candidates) runs them one after another, candidate
i seeded ``seed + i``; each prefills the prompt again (one live request at a time: no shared
prefill before batching). With logprobs asked for (or needed to rank ``best_of``), each delta
carries the logprobs of the tokens whose text it releases (core/openai_logprobs.py).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections import OrderedDict, deque

import attrs
import structlog

from draftflow.core.errors import DraftflowError
from draftflow.core.node import MAX_SEED, SamplingParams
from draftflow.core.openai_logprobs import TokenText, TokenTexts
from draftflow.core.serve_metrics import Metrics
from draftflow.core.tracing import RequestStats

log = structlog.get_logger("draftflow")


class QueueFull(Exception):
    """Raised by ``FairQueue.put`` when ``max_waiting`` requests are already waiting (HTTP 503)."""


class StopScanner:
    """Turns committed token ids into text deltas, holding back what a stop string may still claim.

    After every cycle the whole output is decoded again (byte-level BPE decoding is
    prefix-stable except for an unfinished UTF-8 character, shown as U+FFFD and held back).
    The earliest occurrence of any stop string ends the text just before it; a tail that is
    a prefix of some stop string is held back until it is decided.
    """

    def __init__(self, decode, stop: tuple[str, ...] = ()):
        self.decode, self.stop = decode, tuple(stop)
        self.longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already handed out

    def feed(self, ids) -> tuple[str, bool]:
        """Add committed ids; return (text safe to send now, whether a stop string was hit)."""
        self.ids.extend(ids)
        text = self.decode(self.ids)
        if self.stop:
            start = max(0, self.sent - self.longest + 1)
            hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
            if hits:
                end = max(min(hits), self.sent)
                delta, self.sent = text[self.sent:end], end
                return delta, True
        safe = len(text.rstrip("\ufffd"))
        for k in range(min(self.longest - 1, safe - self.sent), 0, -1):
            if any(s.startswith(text[safe - k:safe]) for s in self.stop):
                safe -= k
                break
        delta, self.sent = text[self.sent:safe], max(safe, self.sent)
        return delta, False

    def flush(self) -> str:
        """Everything not yet sent (the request ended without a stop string)."""
        text = self.decode(self.ids)
        delta, self.sent = text[self.sent:], len(text)
        return delta


@attrs.define(eq=False)
class ServeRequest:
    """One queued or running request. The worker writes ``events``; the HTTP handler reads them.

    Events: ``("delta", index, text, pieces)`` (``pieces``: the openai_logprobs.TokenText of the
    tokens this text belongs to, or None without logprobs), ``("finish", index, finish_reason, info)``
    (``info``, the usage and stats of the whole request, on the last choice only), and
    ``("error", status, message)``. Choices come one after another, in index order.
    """

    id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    client: str = "-"  # fairness key
    n: int = 1  # choices returned
    best_of: int = 1  # candidates run (>= n); the n with the highest total logprob are returned
    logprobs: bool = False  # whether the choices carry their tokens' logprobs
    events: queue.Queue = attrs.field(factory=queue.Queue)
    cancelled: threading.Event = attrs.field(factory=threading.Event)
    enqueued_at: float = attrs.field(factory=time.perf_counter)
    started_at: float | None = None
    first_token_at: float | None = None
    stats: RequestStats = attrs.field(factory=RequestStats)  # the executor's, once started (metrics read it)

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}"


class FairQueue:
    """Waiting requests, one FIFO lane per client key, served round-robin across lanes.

    ``get`` takes the head of the first lane and moves that lane to the back, so a client
    with 100 waiting requests and a client with 1 alternate instead of queueing in order.
    """

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self._lanes: OrderedDict[str, deque] = OrderedDict()
        self._size = 0
        self._cv = threading.Condition()

    def __len__(self) -> int:
        return self._size

    def put(self, req: ServeRequest) -> None:
        with self._cv:
            if self._size >= self.max_waiting:
                raise QueueFull(f"{self._size} requests are waiting (the limit is {self.max_waiting}); retry later")
            self._lanes.setdefault(req.client, deque()).append(req)
            self._size += 1
            self._cv.notify()

    def get(self, timeout: float) -> ServeRequest | None:
        with self._cv:
            if not self._cv.wait_for(lambda: self._size > 0, timeout):
                return None
            key, lane = self._lanes.popitem(last=False)
            req = lane.popleft()
            if lane:
                self._lanes[key] = lane  # back of the rotation
            self._size -= 1
            return req

    def remove(self, req: ServeRequest) -> bool:
        """Take a waiting request out (its client went away); False if it is not waiting."""
        with self._cv:
            lane = self._lanes.get(req.client)
            if lane is None or req not in lane:
                return False
            lane.remove(req)
            if not lane:
                del self._lanes[req.client]
            self._size -= 1
            return True

    def drain(self) -> list[ServeRequest]:
        with self._cv:
            out = [r for lane in self._lanes.values() for r in lane]
            self._lanes.clear()
            self._size = 0
            return out


class Engine:
    """Owns a ``Session``; one worker thread runs queued requests through its executor in turn."""

    def __init__(self, session, max_waiting: int = 64, start: bool = True):
        self.session = session
        self.executor = session.executor
        self.queue = FairQueue(max_waiting)
        self.metrics = Metrics()
        self.running: ServeRequest | None = None
        self._closing = threading.Event()
        tokenizer = self.executor.handle.tokenizer
        self.decode = tokenizer.decode if tokenizer is not None else (lambda ids: "")
        self._thread = threading.Thread(target=self._work, name="draftflow-worker", daemon=True)
        if start:
            self._thread.start()

    @property
    def context_tokens(self) -> int | None:
        return self.executor.kv_tokens

    def submit(self, req: ServeRequest) -> None:
        """Queue a request; raises QueueFull when the waiting line is full."""
        if self._closing.is_set():
            raise QueueFull("the server is shutting down")
        self.queue.put(req)
        self.metrics.set_gauges(waiting=len(self.queue))

    def cancel(self, req: ServeRequest) -> None:
        """Client went away: drop it from the queue, or stop it after its current cycle."""
        req.cancelled.set()
        if self.queue.remove(req):
            self.metrics.finish(req, "cancelled", 0)
            self.metrics.set_gauges(waiting=len(self.queue))

    def close(self) -> None:
        self._closing.set()
        if self.running is not None:
            self.running.cancelled.set()
        for req in self.queue.drain():
            req.events.put(("error", 503, "the server is shutting down"))
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # --- worker -------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._closing.is_set():
            req = self.queue.get(timeout=0.2)
            if req is None:
                continue
            self.metrics.set_gauges(waiting=len(self.queue), running=1)
            try:
                self._run(req)
            finally:
                self.running = None
                self.metrics.set_gauges(waiting=len(self.queue), running=0)

    def _run(self, req: ServeRequest) -> None:
        if req.cancelled.is_set():
            self.metrics.finish(req, "cancelled", 0)
            return
        req.started_at = time.perf_counter()
        req.stats = RequestStats()  # every candidate's cycles, for the metrics
        self.running = req
        live = req.best_of == req.n  # choices go out as they are generated; best_of waits for the best
        candidates = []
        try:
            for i in range(req.best_of):
                candidates.append(self._generate(req, i, live))
                if req.cancelled.is_set():
                    break
                if live and i < req.best_of - 1:  # the last choice's finish carries the request's info
                    req.events.put(("finish", i, candidates[-1].finish, None))
        except DraftflowError as exc:  # RequestError: prompt past the context, ids outside the vocabulary
            self.metrics.finish(req, "error", 0)
            req.events.put(("error", 400, str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - a bug must not take the server down
            log.error("request_failed", status=500, request_id=req.id, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            self.metrics.finish(req, "error", 0)
            req.events.put(("error", 500, f"internal error while generating: {type(exc).__name__}: {exc}"))
            return
        done = time.perf_counter()
        generated = sum(len(c.result.token_ids) for c in candidates)
        stats = candidates[0].result.stats if len(candidates) == 1 else {
            **req.stats.summary(), "tokens_per_s": round(generated / (done - req.started_at), 3),
            "choices": [c.result.stats for c in candidates]}
        info = {"prompt_tokens": len(req.prompt_ids), "completion_tokens": generated,
                "stats": {**stats, "queue_s": round(req.started_at - req.enqueued_at, 6),
                          "latency_s": round(done - req.enqueued_at, 6)}}
        if live:
            req.events.put(("finish", len(candidates) - 1, candidates[-1].finish, info))
            chosen = candidates
        else:  # best_of: the n likeliest candidates, best first
            chosen = sorted(candidates, key=lambda c: -c.logprob)[:req.n]
            for index, c in enumerate(chosen):
                for _, _, text, pieces in c.deltas:
                    req.events.put(("delta", index, text, pieces))
                req.events.put(("finish", index, c.finish, info if index == len(chosen) - 1 else None))
        reason = "cancelled" if req.cancelled.is_set() else chosen[0].finish
        self.metrics.finish(req, reason, generated, done)

    def _generate(self, req: ServeRequest, index: int, live: bool) -> Candidate:
        """One candidate through start/step/finish, its deltas streamed (``live``) or kept; a stop string or a
        cancel ends it between cycles."""
        ex = self.executor
        sampling = req.sampling
        if sampling.seed is not None and index:  # candidate i of a seeded request: seed + i
            sampling = attrs.evolve(sampling, seed=(sampling.seed + index) % (MAX_SEED + 1))
        state = ex.start(req.prompt_ids, sampling, req.id if index == 0 else f"{req.id}-{index}")
        scanner = StopScanner(self.decode, req.stop)
        texts = TokenTexts(self.decode, req.prompt_ids) if sampling.logprobs is not None else None
        out = Candidate()
        pending: list[TokenText] = []  # pieces of tokens whose text is not sent yet

        def send(text: str, upto: int | None) -> None:
            nonlocal pending
            pieces = None
            if texts is not None:  # the tokens whose text starts in what was sent so far
                keep = len(pending) if upto is None else sum(p.offset < upto for p in pending)
                pieces, pending = pending[:keep], pending[keep:]
                out.kept.extend(pieces)
            if text or pieces:
                event = ("delta", index, text, pieces if req.logprobs else None)
                req.events.put(event) if live else out.deltas.append(event)

        reason = None  # None: the executor's own finish (EOS, stop token, max_new_tokens)
        while True:
            (cycle,) = ex.step([state])
            if req.first_token_at is None:
                req.first_token_at = time.perf_counter()
            if texts is not None:
                pending += [texts.add(lp.token, lp.logprob, lp.top) for lp in cycle.logprobs or ()]
            delta, hit = scanner.feed(cycle.emitted)
            send(delta, scanner.sent)
            if hit:  # the text ends before the stop string; every committed token still counts
                reason = "stop"
                break
            if req.cancelled.is_set():
                reason = "cancelled"
                break
            if cycle.finish is not None:
                break
        if reason != "stop":
            send(scanner.flush(), None)
        out.result = ex.finish(state, reason, kept=len(scanner.ids))
        merge_stats(req.stats, state.stats)
        out.finish = out.result.finish_reason
        out.logprob = sum(p.logprob for p in out.kept)
        return out


@attrs.define(eq=False)
class Candidate:
    """One generated choice: its result, the deltas kept for later (best_of), its kept tokens' pieces."""

    result: object = None  # the executor's Result
    finish: str = ""
    deltas: list = attrs.field(factory=list)
    kept: list = attrs.field(factory=list)  # TokenText of the tokens whose text is returned
    logprob: float = 0.0  # their total logprob (best_of ranks by it)


def merge_stats(total: RequestStats, part: RequestStats) -> None:
    """Add one candidate's cycle counts to the request's (n > 1 runs several)."""
    for name in ("cycles", "drafting_cycles", "drafted", "accepted", "emitted"):
        setattr(total, name, getattr(total, name) + getattr(part, name))
    for name in ("accepted_at", "proposed_at"):
        into, add = getattr(total, name), getattr(part, name)
        into.extend([0] * (len(add) - len(into)))
        for i, value in enumerate(add):
            into[i] += value
