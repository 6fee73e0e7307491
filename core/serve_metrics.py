"""Prometheus metrics of `draftflow serve`, in the text exposition format (no client library).

Speculative-decoding counters follow vLLM's definitions (docs/TRACING.md): a *draft* is
one cycle that proposed at least one token; mean acceptance length = 1 + accepted / drafts;
per-position rate = accepted_per_pos[i] / drafts. Every name is listed in docs/SERVING.md.
"""

from __future__ import annotations

import threading
import time
from collections import deque

PREFIX = "draftflow"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the CUDA-graph batch buckets, then the graph's largest max_batch
DRAFT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 16, 24, 32)  # draft lengths: every small K, then coarser
RATE_WINDOW_S = 10.0  # tokens/s is the committed tokens of the cycles that ended in this last window
FINISH_REASONS = ("stop", "length", "cancelled", "error")


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """Counters, gauges and histograms of one server; every method is thread-safe."""

    def __init__(self, slots: int = 1):
        self._lock = threading.Lock()
        self.slots = slots
        self.requests = dict.fromkeys(FINISH_REASONS, 0)
        self.http_errors: dict[int, int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cycles = 0
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_pos: list[int] = []
        self.waiting = 0
        self.running = 0
        self.batch = 0
        self.latency = Histogram()
        self.ttft = Histogram()
        self.queue_time = Histogram()
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.cycle_k = Histogram(DRAFT_BUCKETS)
        self.draft_length = Histogram(DRAFT_BUCKETS)
        self.started = time.perf_counter()
        self._recent: deque[tuple[float, int]] = deque()  # (cycle end, tokens committed) within RATE_WINDOW_S

    def set_gauges(self, waiting: int | None = None, running: int | None = None, batch: int | None = None) -> None:
        with self._lock:
            if waiting is not None:
                self.waiting = waiting
            if running is not None:
                self.running = running
            if batch is not None:
                self.batch = batch

    def admitted(self, req) -> None:
        """A request left the queue for a slot (``req.started_at`` set)."""
        with self._lock:
            self.queue_time.observe(req.started_at - req.enqueued_at)

    def first_token(self, req) -> None:
        """The first cycle of a request ended (``req.first_token_at`` set)."""
        with self._lock:
            self.ttft.observe(req.first_token_at - req.enqueued_at)

    def cycle(self, results, now: float) -> None:
        """One batched cycle: ``results``, its CycleResults (one per request stepped)."""
        with self._lock:
            self.batch = len(results)
            self.batch_size.observe(len(results))
            self.cycle_k.observe(results[0].num_draft)
            for r in results:
                self.draft_length.observe(len(r.draft))
            self._recent.append((now, sum(len(r.emitted) for r in results)))

    def tokens_per_s(self, now: float) -> float:
        """Tokens committed per second over the last RATE_WINDOW_S (or since the server started, if sooner)."""
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        span = min(RATE_WINDOW_S, now - self.started)
        return sum(n for _, n in self._recent) / span if span > 0 else 0.0

    def http_error(self, status: int) -> None:
        with self._lock:
            self.http_errors[status] = self.http_errors.get(status, 0) + 1

    def finish(self, req, reason: str, completion_tokens: int, done: float | None = None) -> None:
        """Account one finished request (any reason); ``req`` is a ``ServeRequest``."""
        s = req.stats
        with self._lock:
            self.requests[reason] += 1
            if reason == "error":
                return
            self.prompt_tokens += len(req.prompt_ids) if req.started_at is not None else 0
            self.generation_tokens += completion_tokens
            self.cycles += s.cycles
            self.drafts += s.drafting_cycles
            self.draft_tokens += s.drafted
            self.accepted_tokens += s.accepted
            while len(self.accepted_per_pos) < len(s.accepted_at):
                self.accepted_per_pos.append(0)
            for i, n in enumerate(s.accepted_at):
                self.accepted_per_pos[i] += n
            if reason != "cancelled":
                self.latency.observe((done or time.perf_counter()) - req.enqueued_at)

    def render(self) -> str:
        p = PREFIX
        with self._lock:
            rate = self.tokens_per_s(time.perf_counter())
            blocks = [
                ("counter", f"{p}_requests_total", "Finished requests by finish reason",
                 [f'{p}_requests_total{{finish_reason="{r}"}} {n}' for r, n in self.requests.items()]),
                ("counter", f"{p}_http_errors_total", "Error responses by HTTP status",
                 [f'{p}_http_errors_total{{status="{s}"}} {n}' for s, n in sorted(self.http_errors.items())]),
                ("gauge", f"{p}_requests_waiting", "Requests in the queue", [f"{p}_requests_waiting {self.waiting}"]),
                ("gauge", f"{p}_requests_running", "Requests being generated", [f"{p}_requests_running {self.running}"]),
                ("gauge", f"{p}_batch_size", "Request slots stepped in the last cycle (n/best_of candidates count one each)",
                 [f"{p}_batch_size {self.batch}"]),
                ("gauge", f"{p}_batch_slots", "Request slots (the graph's max_batch)", [f"{p}_batch_slots {self.slots}"]),
                ("gauge", f"{p}_generation_tokens_per_second", f"Tokens committed per second over the last {RATE_WINDOW_S:g} s",
                 [f"{p}_generation_tokens_per_second {rate:.3f}"]),
                ("counter", f"{p}_prompt_tokens_total", "Prompt tokens of started requests",
                 [f"{p}_prompt_tokens_total {self.prompt_tokens}"]),
                ("counter", f"{p}_generation_tokens_total", "Generated tokens",
                 [f"{p}_generation_tokens_total {self.generation_tokens}"]),
                ("counter", f"{p}_spec_decode_num_cycles_total", "Draft-verify cycles run",
                 [f"{p}_spec_decode_num_cycles_total {self.cycles}"]),
                ("counter", f"{p}_spec_decode_num_drafts_total", "Cycles that proposed at least one draft token",
                 [f"{p}_spec_decode_num_drafts_total {self.drafts}"]),
                ("counter", f"{p}_spec_decode_num_draft_tokens_total", "Draft tokens proposed",
                 [f"{p}_spec_decode_num_draft_tokens_total {self.draft_tokens}"]),
                ("counter", f"{p}_spec_decode_num_accepted_tokens_total", "Draft tokens accepted",
                 [f"{p}_spec_decode_num_accepted_tokens_total {self.accepted_tokens}"]),
                ("counter", f"{p}_spec_decode_num_accepted_tokens_per_pos_total", "Accepted draft tokens by draft position",
                 [f'{p}_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {n}'
                  for i, n in enumerate(self.accepted_per_pos)]),
                ("histogram", f"{p}_batch_size_per_cycle", "Requests stepped together, one observation per cycle",
                 self.batch_size.lines(f"{p}_batch_size_per_cycle")),
                ("histogram", f"{p}_spec_decode_cycle_num_draft", "The cycle's K (widest draft any row asked for), per cycle",
                 self.cycle_k.lines(f"{p}_spec_decode_cycle_num_draft")),
                ("histogram", f"{p}_spec_decode_draft_length", "Draft tokens proposed to one request in one cycle",
                 self.draft_length.lines(f"{p}_spec_decode_draft_length")),
                ("histogram", f"{p}_request_latency_seconds", "Time from arrival to the last token (finished requests)",
                 self.latency.lines(f"{p}_request_latency_seconds")),
                ("histogram", f"{p}_time_to_first_token_seconds", "Time from arrival to the end of the first cycle",
                 self.ttft.lines(f"{p}_time_to_first_token_seconds")),
                ("histogram", f"{p}_queue_time_seconds", "Time from arrival to the start of generation",
                 self.queue_time.lines(f"{p}_queue_time_seconds")),
            ]
        out = []
        for kind, name, help_text, lines in blocks:
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *lines]
        return "\n".join(out) + "\n"
