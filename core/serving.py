"""Serving: one worker thread owns the executor and runs every admitted request in one batch.

HTTP threads only parse, queue (``FairQueue``: round-robin over client keys, FIFO within a
client) and write. The worker loops over draft cycles:

1. **reap**: a request whose client went away (or that the server is shutting down) is
   ended with ``finish(reason="cancelled")``, which frees its slot before the next cycle;
2. **admit**: while the executor has a free slot, the next candidate of an already admitted
   request (``n`` / ``best_of``) or else the next request of the fair queue is ``start``-ed
   into the free slot with its prefill deferred (the live requests are untouched);
3. **prefill** joining requests, at most ``prefill_budget`` prompt tokens between two cycles
   while others decode (all of it when nothing decodes): a long prompt joins in chunks and
   stalls the running requests by one chunk per cycle, not by its whole prefill;
4. **step** every prefilled live request in one ``Executor.step`` (one batched cycle, one host sync),
   then per request: the committed tokens become text deltas for its HTTP handler, a stop
   string or the executor's own finish (EOS, stop token, max_tokens) ends it with
   ``finish``, and its slot is free for step 2 of the next loop.

No request starves: an admitted request runs to its end (nothing preempts it and each has a
max_tokens budget), and the waiting line is served round-robin across clients, FIFO within
one. A failed ``start`` fails only the joining request (400 for a DraftflowError, else 500);
a failed ``step`` invalidates every live request (the executor drops them), so each request
in that cycle gets the error and the next cycle starts with new requests only.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections import deque

import attrs
import structlog

from draftflow.core.errors import DraftflowError
from draftflow.core.fair_queue import FairQueue, QueueFull
from draftflow.core.node import SamplingParams
from draftflow.core.serve_candidate import Candidate
from draftflow.core.serve_metrics import Metrics
from draftflow.core.tracing import RequestStats

__all__ = ["Engine", "QueueFull", "ServeRequest"]
log = structlog.get_logger("draftflow")
IDLE_WAIT_S = 0.2  # how long an idle worker blocks on the queue before it looks at the closing flag again
PREFILL_BUDGET = 512  # prompt tokens prefilled between two cycles while requests decode (serve --prefill-budget)


@attrs.define(eq=False)
class ServeRequest:
    """One queued or running request. The worker writes ``events``; the HTTP handler reads them.

    Events: ``("delta", index, text, pieces)`` (``pieces``: the openai_logprobs.TokenText of the
    tokens this text belongs to, or None without logprobs), ``("finish", index, finish_reason, info)``
    (``info``, the usage and stats of the whole request, on the last event only), and
    ``("error", status, message)``. The choices of a streamed ``n > 1`` request run side by side,
    so their deltas interleave (each carries its index); the finish with ``info`` comes last.
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
    stats: RequestStats = attrs.field(factory=RequestStats)  # every candidate's cycles (metrics read it)
    candidates: list = attrs.field(factory=list)  # its Candidates, once admitted
    open: int = 0  # candidates not finished yet
    failed: bool = False  # an error event went out; nothing more is sent

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}"


class Engine:
    """Owns a ``Session``; one worker thread runs the admitted requests through its executor, batched."""

    def __init__(self, session, max_waiting: int = 64, start: bool = True, decode=None,
                 prefill_budget: int = PREFILL_BUDGET):
        """``decode``: token ids -> text (default: the target's tokenizer); ``start``: run the worker now;
        ``prefill_budget``: prompt tokens prefilled between two cycles while requests decode."""
        self.session = session
        self.prefill_budget = prefill_budget
        self.executor = session.executor
        self.max_batch = self.executor.max_batch
        self.queue = FairQueue(max_waiting)
        self.metrics = Metrics(slots=self.max_batch)
        self.live: list[Candidate] = []  # candidates holding a slot, in the order they started
        self.ready: deque[Candidate] = deque()  # candidates of admitted requests waiting for a slot
        self.admitted: list[ServeRequest] = []  # taken from the queue, not answered yet
        self._closing = threading.Event()
        tokenizer = self.executor.handle.tokenizer
        self.decode = decode or (tokenizer.decode if tokenizer is not None else (lambda ids: ""))
        self._thread = threading.Thread(target=self._work, name="draftflow-worker", daemon=True)
        if start:
            self.start()

    @classmethod
    def open_in_worker(cls, opener, **kwargs) -> "Engine":
        """Open the session (``opener()``, e.g. ``Session.open``: load, warm up) on the worker thread itself, then run
        the worker there; returns once it is open, or raises what ``opener`` raised. On the CPU every thread that
        runs torch's parallel regions gets its own OpenMP team, and with two teams on the cores (the one that warmed
        the model up, the one that decodes) libgomp stops spinning between regions: the demo graph's 64-token
        request took 263-270 ms on a worker thread after a main-thread open, 177-187 ms where it was opened."""
        opened, box = threading.Event(), {}

        def work() -> None:
            try:
                engine = cls(opener(), start=False, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller (CheckError, FollowerDone, ...)
                box["error"] = exc
                opened.set()
                return
            engine._thread = threading.current_thread()
            box["engine"] = engine
            opened.set()
            engine._work()

        threading.Thread(target=work, name="draftflow-worker", daemon=True).start()
        opened.wait()
        if "error" in box:
            raise box["error"]
        return box["engine"]

    def start(self) -> None:
        """Start the worker thread (``Engine(..., start=False)`` defers it, e.g. to queue requests first)."""
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
        """Client went away: drop it from the queue, or end it before the next cycle."""
        req.cancelled.set()
        if self.queue.remove(req):
            self.metrics.finish(req, "cancelled", 0)
            self.metrics.set_gauges(waiting=len(self.queue))

    def close(self) -> None:
        self._closing.set()
        for req in self.queue.drain():
            req.events.put(("error", 503, "the server is shutting down"))
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # --- worker -------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            closing = self._closing.is_set()
            if closing:  # the admitted requests end as cancelled (their clients get what was generated)
                for req in self.admitted:
                    req.cancelled.set()
            self._reap()
            if closing and not self.live:
                return
            if not closing:
                self._admit()
            if self.live:
                self._prefill()
                self._cycle()
            self._gauges()

    def _gauges(self) -> None:
        self.metrics.set_gauges(waiting=len(self.queue), running=len(self.admitted), batch=len(self.live))

    def _reap(self) -> None:
        """End every cancelled request's candidates (live ones through ``finish``, which frees their slots)."""
        for cand in [c for c in self.live if c.req.cancelled.is_set()]:
            self._end(cand, "cancelled")
        for cand in [c for c in self.ready if c.req.cancelled.is_set()]:
            self.ready.remove(cand)
            cand.finish = "cancelled"
            self._closed(cand)

    def _admit(self) -> None:
        """Fill the free slots: waiting candidates of admitted requests first, then the fair queue's next requests.
        With nothing live, wait for a request instead of spinning."""
        wait = IDLE_WAIT_S if not self.live and not self.ready else 0
        while self.executor.free_slots > 0:
            if not self.ready:
                req = self.queue.get(timeout=wait)
                wait = 0
                if req is None:
                    return
                self._accept(req)
                continue
            self._start(self.ready.popleft())

    def _accept(self, req: ServeRequest) -> None:
        """A request leaves the queue: its candidates wait for slots (the first one gets the free slot at once)."""
        if req.cancelled.is_set():
            self.metrics.finish(req, "cancelled", 0)
            return
        req.started_at = time.perf_counter()
        req.stats = RequestStats()
        req.candidates = [Candidate.of(req, i, self.decode) for i in range(req.best_of)]
        req.open = len(req.candidates)
        self.admitted.append(req)
        self.ready.extend(req.candidates)
        self.metrics.admitted(req)

    def _start(self, cand: Candidate) -> None:
        try:
            cand.state = self.executor.start(cand.req.prompt_ids, cand.sampling, cand.request_id, defer_prefill=True)
        except DraftflowError as exc:  # RequestError: prompt past the context, ids outside the vocabulary
            self._fail(cand.req, 400, str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug must not take the server down; only this prefill failed
            self._fail(cand.req, 500, self._internal(cand.req, exc))
        else:
            self.live.append(cand)

    def _prefill(self) -> None:
        """Prefill joining candidates in start order, those that fit together in one batched prefill: up to
        ``prefill_budget`` prompt tokens while others decode, all of them when nothing does."""
        joining = [c for c in self.live if not c.state.ready]
        if not joining:
            return
        budget = self.prefill_budget if any(c.state.ready for c in self.live) else None
        try:
            self.executor.prefill_many([c.state for c in joining], budget)
        except Exception as exc:  # noqa: BLE001 - only the joining requests whose prefill failed (slots freed)
            held = {id(state) for state in self.executor.live()}
            for cand in joining:
                if id(cand.state) not in held:
                    status = 400 if isinstance(exc, DraftflowError) else 500
                    self._fail(cand.req, status, str(exc) if status == 400 else self._internal(cand.req, exc))

    def _cycle(self) -> None:
        """One batched cycle for every prefilled live candidate, then each one's deltas, stop strings and finish."""
        cands = [c for c in self.live if c.state.ready]
        if not cands:
            return
        try:
            results = self.executor.step([c.state for c in cands])
        except Exception as exc:  # noqa: BLE001 - the executor dropped every live request; each gets the error
            for req in dict.fromkeys(c.req for c in cands):
                status = 400 if isinstance(exc, DraftflowError) else 500
                self._fail(req, status, str(exc) if status == 400 else self._internal(req, exc))
            return
        now = time.perf_counter()
        self.metrics.cycle(results, now)
        for cand, cycle in zip(cands, results):
            req = cand.req
            if req.failed:  # an earlier candidate's finish failed it
                continue
            if req.first_token_at is None:
                req.first_token_at = now
                self.metrics.first_token(req)
            hit = cand.feed(cycle)
            if hit:
                self._end(cand, "stop")
            elif req.cancelled.is_set():
                self._end(cand, "cancelled")
            elif cycle.finish is not None:
                self._end(cand, None)

    def _end(self, cand: Candidate, reason: str | None) -> None:
        """Finish one candidate (its slot is free afterwards); the request is answered once all have ended.

        ``reason``: None = the executor's own finish, "stop" = a stop string, "cancelled"."""
        self.live.remove(cand)
        req = cand.req
        try:
            if reason != "stop":
                cand.flush()
            cand.done(self.executor.finish(cand.state, reason, kept=len(cand.scanner.ids)))
        except Exception as exc:  # noqa: BLE001 - e.g. a request_done sink that raises
            if not cand.state.done:
                self._drop(cand)
            self._fail(req, 500, self._internal(req, exc))
            return
        merge_stats(req.stats, cand.state.stats)
        self._closed(cand)

    def _closed(self, cand: Candidate) -> None:
        """One candidate is over (finished, or cancelled before it started): the request's finish event(s)."""
        req = cand.req
        req.open -= 1
        if req.open > 0:
            if cand.live and cand.result is not None:
                req.events.put(("finish", cand.index, cand.finish, None))
            return
        self.admitted.remove(req)
        done = time.perf_counter()
        ran = [c for c in req.candidates if c.result is not None]
        generated = sum(len(c.result.token_ids) for c in ran)
        if len(req.candidates) == 1 and ran:
            stats = ran[0].result.stats
        else:
            stats = {**req.stats.summary(), "tokens_per_s": round(generated / (done - req.started_at), 3),
                     "choices": [c.result.stats for c in ran]}
        info = {"prompt_tokens": len(req.prompt_ids), "completion_tokens": generated,
                "stats": {**stats, "queue_s": round(req.started_at - req.enqueued_at, 6),
                          "latency_s": round(done - req.enqueued_at, 6)}}
        if cand.live:  # the other choices' finish events went out as they ended
            req.events.put(("finish", cand.index, cand.finish, info))
            chosen = ran
        else:  # best_of: the n likeliest candidates, best first
            chosen = sorted(ran, key=lambda c: -c.logprob)[:req.n]
            for index, c in enumerate(chosen):
                for _, _, text, pieces in c.deltas:
                    req.events.put(("delta", index, text, pieces))
                req.events.put(("finish", index, c.finish, info if index == len(chosen) - 1 else None))
            if not chosen:
                req.events.put(("finish", 0, "cancelled", info))
        reason = "cancelled" if req.cancelled.is_set() or not chosen else chosen[0].finish
        self.metrics.finish(req, reason, generated, done)

    def _fail(self, req: ServeRequest, status: int, message: str) -> None:
        """End every candidate of ``req`` (freeing its slots) and send one error event."""
        if req.failed:
            return
        req.failed = True
        for cand in req.candidates:
            if cand in self.live:
                self.live.remove(cand)
                self._drop(cand)
            elif cand in self.ready:
                self.ready.remove(cand)
        if req in self.admitted:
            self.admitted.remove(req)
        self.metrics.finish(req, "error", 0)
        req.events.put(("error", status, message))

    def _drop(self, cand: Candidate) -> None:
        """End a candidate that failed: its slot is freed (its request_done says "error")."""
        if cand.state.done:
            return
        try:
            self.executor.finish(cand.state, "error")
        except Exception:  # noqa: BLE001 - the request's error event is what the client needs to see
            pass

    @staticmethod
    def _internal(req: ServeRequest, exc: Exception) -> str:
        log.error("request_failed", status=500, request_id=req.id, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        return f"internal error while generating: {type(exc).__name__}: {exc}"


def merge_stats(total: RequestStats, part: RequestStats) -> None:
    """Add one candidate's cycle counts to the request's (n > 1 runs several)."""
    for name in ("cycles", "drafting_cycles", "drafted", "accepted", "emitted"):
        setattr(total, name, getattr(total, name) + getattr(part, name))
    for name in ("accepted_at", "proposed_at"):
        into, add = getattr(total, name), getattr(part, name)
        into.extend([0] * (len(add) - len(into)))
        for i, value in enumerate(add):
            into[i] += value
