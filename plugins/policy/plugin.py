"""The `adaptive_k` node: chooses every cycle's draft length K from live acceptance and measured cost.

For the rows of a cycle it picks the K in [0, K_max] that maximises expected emitted tokens
per second of the whole batch, ``sum_rows E_row(K) / cost(batch, K)`` (model.py), down to
K = 0 (target-only steps) when speculation cannot pay at this load. K_max is the graph's
``num_draft`` (also capped by each row's token budget). Costs are learnt per batch size
bucket: the first cycles at a bucket measure K_max and K = 0 twice each (a first cycle carries one-off costs;
a cost is the lowest of its last few measurements), later ones the best K; after
``explore_every`` cycles a neighbour of the best (or an end point) is re-measured, so the
table follows the load, and the gap doubles while the best K holds (up to 16 times), so a
settled answer costs little exploration. Lossless like every K: only speed depends on it.
With ``sampled_only`` it chooses only for cycles with a sampled row (greedy cycles draft
``num_draft``), for graphs whose fixed K is the fastest measured greedy setting.
"""

from __future__ import annotations

from draftflow.plugin import Manifest, Node, NodeType, ParamSpec, hookimpl
from draftflow.plugins.policy.model import FIRST_SAMPLES, Acceptance, CycleCosts

BACKOFF_CAP = 16  # exploration is at most this many times rarer than explore_every
GRID = (0, 1, 3, 7, 15, 31, 63)  # K values chosen by default: few window widths, so few CUDA graphs to capture
PARAMS = (
    ParamSpec("ks", "int_list", [], "the K values it may choose (default: 0, 1, 3, 7, 15, 31, 63 up to num_draft, and "
              "num_draft itself); each new window width costs a CUDA graph capture on the GPU", minimum=0),
    ParamSpec("explore_every", "int", 16, "re-measure a neighbouring K after this many cycles (0: never); the gap doubles "
              "while the best K holds, up to 16 times this", minimum=0),
    ParamSpec("step", "int", 1, "how many grid places from the best K the re-measured neighbour lies", minimum=1),
    ParamSpec("sampled_only", "bool", False, "choose K only for cycles with a sampled (temperature > 0) row: a "
              "cycle of greedy rows drafts num_draft, and greedy requests' acceptance is not counted (for a graph "
              "whose fixed num_draft measured fastest at T = 0, e.g. graphs/demo.yaml)"),
)


def manifest(params, env) -> Manifest:
    return Manifest(role="policy", provides={"policy.draft_length"})


class AdaptiveK(Node):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.acceptance = Acceptance(max(ctx.num_draft, 1))
        self.costs = CycleCosts()
        self.cycles = 0
        self.best, self.gap = -1, ctx.params["explore_every"]  # exploration backs off while the best K holds
        self.next_explore = self.gap
        given = ctx.params.get("ks") or [k for k in GRID if k <= ctx.num_draft] + [ctx.num_draft]
        self.grid = sorted({k for k in given if k <= ctx.num_draft} | {0})  # K = 0 is always allowed
        self.sampled_only = bool(ctx.params.get("sampled_only"))

    def choose_draft(self, batch) -> int:
        k_max = max(k for k in self.grid if k <= batch.num_draft)  # the widest allowed K this cycle may use
        rows = [req for _, req in batch.active()]
        if self.sampled_only and all(r.sampling.temperature == 0 for r in rows):
            return batch.num_draft
        n = len(rows)
        if self.costs.count(n, k_max) < FIRST_SAMPLES:  # first cycles at this batch size: measure both ends twice
            choice = k_max
        elif self.costs.count(n, 0) < FIRST_SAMPLES:
            choice = 0
        else:
            choice = self._best(rows, k_max)
            every = self.ctx.params["explore_every"]
            if choice != self.best:  # the answer moved: look around often again
                self.best, self.gap = choice, every
            if every and self.cycles >= self.next_explore:
                choice = self._explore(n, choice, k_max)
                self.next_explore = self.cycles + self.gap
                self.gap = min(2 * self.gap, BACKOFF_CAP * every)  # a settled answer is re-checked ever more rarely
        return choice

    def _best(self, rows, k_max: int) -> int:
        best, best_rate = 0, -1.0
        for k in (k for k in self.grid if k <= k_max):
            ms = self.costs.estimate(len(rows), k)
            tokens = sum(self.acceptance.expected(self.acceptance.rates(r.request_id, k), min(k, r.num_draft))
                         for r in rows)
            rate = tokens / max(ms, 1e-6)
            if rate > best_rate * (1 + 1e-9):  # ties go to the smaller K
                best, best_rate = k, rate
        return best

    def _explore(self, n: int, best: int, k_max: int) -> int:
        """The least recently measured of the best's neighbours on the grid (`step` places away) and the two ends."""
        step, grid = self.ctx.params["step"], [k for k in self.grid if k <= k_max]
        at = grid.index(best)
        options = {grid[max(0, at - step)], grid[min(len(grid) - 1, at + step)], 0, k_max} - {best}
        return min(sorted(options), key=lambda k: self.costs.last_seen(n, k)) if options else best

    def observe(self, cost) -> None:
        self.costs.add(cost.batch, cost.num_draft, cost.cycle_ms, self.cycles)
        self.cycles += 1

    def commit(self, req, info):
        if info.num_draft and not (self.sampled_only and req.sampling.temperature == 0):
            self.acceptance.update(req.request_id, info.num_draft, info.accepted)
        return {}

    def release(self, req) -> None:
        self.acceptance.forget(req.request_id)


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="adaptive_k", role="policy", manifest=manifest, factory=AdaptiveK, params=PARAMS,
        capabilities=("policy.draft_length",),
        description="chooses each cycle's draft length from live per-position acceptance and measured cycle cost "
                    "(K = 0 when speculation cannot pay at the current load)"))
