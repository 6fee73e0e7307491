"""What the adaptive draft-length policy knows: acceptance per draft position, and cycle cost per (batch, K).

Acceptance: for every request, the conditional acceptance of draft position j (accepted
given positions 1..j-1 were), counted from its commits with exponential forgetting, and
shrunk towards the same rates over all requests (a new request starts from those).
Expected tokens a row emits in a cycle of K drafts: ``1 + sum_{j<=K} prod_{i<=j} a_i``.

Cost: the measured wall time of whole cycles, an exponential average per (batch bucket,
K); a K not measured at a bucket is interpolated linearly between the nearest measured K
on either side (held flat past the last one).
"""

from __future__ import annotations

import math

PRIOR_WEIGHT = 4.0  # a request's own counts weigh this many trials against the all-request rates
FORGET = 0.95  # per commit: a request's counts decay, so its recent acceptance counts most
COST_ALPHA = 0.25  # weight of a new measurement in a (bucket, K) average


def bucket(batch: int) -> int:
    """Batch sizes grouped by powers of two (1, 2, 4, ...): cost is measured per group."""
    return 1 << max(0, math.ceil(math.log2(max(batch, 1))))


class Acceptance:
    """Conditional acceptance of draft positions 1..K, per request and over all requests."""

    def __init__(self, max_draft: int):
        self.max_draft = max_draft
        self.total = [[0.0, 0.0] for _ in range(max_draft)]  # position j: [accepted, trials] over all requests
        self.own: dict[str, list[list[float]]] = {}

    def update(self, request_id: str, num_draft: int, accepted: int) -> None:
        """A cycle drafted `num_draft` and the verifier accepted the first `accepted` of them."""
        own = self.own.setdefault(request_id, [[0.0, 0.0] for _ in range(self.max_draft)])
        for counts in own:
            counts[0] *= FORGET
            counts[1] *= FORGET
        for j in range(min(accepted + 1, num_draft, self.max_draft)):  # positions tried: up to the first rejection
            hit = 1.0 if j < accepted else 0.0
            for counts in (own[j], self.total[j]):
                counts[0] += hit
                counts[1] += 1.0

    def forget(self, request_id: str) -> None:
        self.own.pop(request_id, None)

    def rates(self, request_id: str) -> list[float]:
        """a_j for j = 1..max_draft: the request's own counts shrunk towards the all-request rate."""
        own = self.own.get(request_id)
        out = []
        for j, (hits, trials) in enumerate(self.total):
            prior = (hits + 1.0) / (trials + 2.0)  # Laplace: 1/2 before anything is seen
            if own is not None:
                prior = (own[j][0] + PRIOR_WEIGHT * prior) / (own[j][1] + PRIOR_WEIGHT)
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
    """Measured wall milliseconds of a cycle per (batch bucket, K)."""

    def __init__(self):
        self.ms: dict[tuple[int, int], float] = {}
        self.seen: dict[tuple[int, int], int] = {}  # cycle index of the last measurement

    def add(self, batch: int, k: int, ms: float, cycle: int) -> None:
        key = (bucket(batch), k)
        old = self.ms.get(key)
        self.ms[key] = ms if old is None else (1 - COST_ALPHA) * old + COST_ALPHA * ms
        self.seen[key] = cycle

    def measured(self, batch: int) -> dict[int, float]:
        b = bucket(batch)
        return {k: ms for (bb, k), ms in self.ms.items() if bb == b}

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
