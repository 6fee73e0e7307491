"""What the adaptive draft-length policy knows: acceptance per draft position, and cycle cost per (batch, K).

Acceptance: for every request and K, the conditional acceptance of draft position j (accepted
given positions 1..j-1 were), counted from its commits with exponential forgetting, and
shrunk towards the same rates over all requests (a new request starts from those).
Expected tokens a row emits in a cycle of K drafts: ``1 + sum_{j<=K} prod_{i<=j} a_i``.

Cost: the measured wall time of whole cycles, the lowest of the last few per (batch bucket,
K); a K not measured at a bucket is interpolated linearly between the nearest measured K
on either side (held flat past the last one). The lowest, not the median: a cycle only
ever costs more than its steady state (a graph's first replay, the drafter ingesting a
request's prompt in its first drafting cycle, the machine busy), and with the two samples
each end has when the policy first compares them, a median is their mean.
"""

from __future__ import annotations

import math
from collections import deque

PRIOR_WEIGHT = 4.0  # a request's own counts weigh this many trials against the all-request rates
# Before anything is seen a draft position counts as accepted this often, worth this many trials: optimistic, so
# a fresh policy drafts and learns (K = 0 teaches it nothing about acceptance) and a bad drafter is found out fast.
OPTIMISM, OPTIMISM_WEIGHT = 0.8, 2.0
FORGET = 0.95  # per commit: a request's counts decay, so its recent acceptance counts most
COST_SAMPLES = 9  # a (bucket, K) cost is the lowest of its last this many cycles
# Cycles at K_max and at K = 0 measured at a batch bucket before their costs are compared: a first cycle carries
# one-off costs. On an H100 the shipped DFlash graph's first cycle at K = 15 (graph uploads, the prompt ingested by
# the drafter) outweighed its steady cost, the policy settled on K = 0 and a 64-token request ran at 0.71x
# target-only (tau 1.10; docs/BENCHMARKS.md, 2026-12-07).
FIRST_SAMPLES = 2


def bucket(batch: int) -> int:
    """Batch sizes grouped by powers of two (1, 2, 4, ...): cost is measured per group."""
    return 1 << max(0, math.ceil(math.log2(max(batch, 1))))


class Acceptance:
    """Conditional acceptance of draft positions 1..K, per request and over all requests, kept per K.

    Kept per K because a drafter's first drafts may depend on how many it drafts (a block
    drafter that shrank its non-causal block to K + 1 rows would accept less at small K; the
    DFlash nodes always draft their whole block and offer its first K rows, so for them the
    rates agree). A K not tried yet borrows the rates pooled over every K.
    """

    def __init__(self, max_draft: int):
        self.max_draft = max_draft
        self.total: dict[int | None, list[list[float]]] = {None: self._empty()}  # K (None: every K) -> per position
        self.own: dict[tuple[str, int], list[list[float]]] = {}  # (request, K) -> per position [accepted, trials]

    def _empty(self) -> list[list[float]]:
        return [[0.0, 0.0] for _ in range(self.max_draft)]

    def update(self, request_id: str, num_draft: int, accepted: int) -> None:
        """A cycle drafted `num_draft` and the verifier accepted the first `accepted` of them."""
        own = self.own.setdefault((request_id, num_draft), self._empty())
        for counts in own:
            counts[0] *= FORGET
            counts[1] *= FORGET
        total = self.total.setdefault(num_draft, self._empty())
        for j in range(min(accepted + 1, num_draft, self.max_draft)):  # positions tried: up to the first rejection
            hit = 1.0 if j < accepted else 0.0
            for counts in (own[j], total[j], self.total[None][j]):
                counts[0] += hit
                counts[1] += 1.0

    def forget(self, request_id: str) -> None:
        for key in [key for key in self.own if key[0] == request_id]:
            del self.own[key]

    def rates(self, request_id: str, k: int | None = None) -> list[float]:
        """a_j for j = 1..max_draft at K = k: the request's own counts shrunk towards the all-request rate."""
        own = self.own.get((request_id, k))
        at_k = self.total.get(k)
        out = []
        for j in range(self.max_draft):
            hits, trials = self.total[None][j]
            prior = (hits + OPTIMISM * OPTIMISM_WEIGHT) / (trials + OPTIMISM_WEIGHT)  # every K pooled
            for counts in (at_k[j] if at_k is not None else None, own[j] if own is not None else None):
                if counts is not None:  # shrink: the all-request rate at this K, then the request's own
                    prior = (counts[0] + PRIOR_WEIGHT * prior) / (counts[1] + PRIOR_WEIGHT)
            out.append(prior)
        return out

    @staticmethod
    def expected(rates: list[float], k: int) -> float:
        """Tokens a row emits in a cycle of k drafts (the bonus token included)."""
        total, run = 1.0, 1.0
        for a in rates[:k]:
            run *= a
            total += run
        return total


class CycleCosts:
    """Measured wall milliseconds of a cycle per (batch bucket, K): the lowest of the last few measurements, so a
    slow cycle (a prompt's first window, a graph capture, the machine busy) does not stick, and a lasting change
    of load shows after COST_SAMPLES cycles."""

    def __init__(self):
        self.samples: dict[tuple[int, int], deque[float]] = {}
        self.seen: dict[tuple[int, int], int] = {}  # cycle index of the last measurement

    def add(self, batch: int, k: int, ms: float, cycle: int) -> None:
        key = (bucket(batch), k)
        self.samples.setdefault(key, deque(maxlen=COST_SAMPLES)).append(ms)
        self.seen[key] = cycle

    def measured(self, batch: int) -> dict[int, float]:
        b = bucket(batch)
        return {k: min(values) for (bb, k), values in self.samples.items() if bb == b}

    def count(self, batch: int, k: int) -> int:
        """Measurements kept for (batch's bucket, k)."""
        return len(self.samples.get((bucket(batch), k), ()))

    def estimate(self, batch: int, k: int) -> float | None:
        """Milliseconds of a cycle of `batch` rows and K = k; None when nothing is measured at that bucket."""
        points = self.measured(batch)
        if not points:
            return None
        if k in points:
            return points[k]
        below = [j for j in points if j < k]
        above = [j for j in points if j > k]
        if below and above:
            lo, hi = max(below), min(above)
            return points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo)
        return points[max(below)] if below else points[min(above)]

    def last_seen(self, batch: int, k: int) -> int:
        return self.seen.get((bucket(batch), k), -1)
