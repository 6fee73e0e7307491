"""DFlash2's greedy selector walk of one request as a CUDA graph per row count.

The walk (`dflash2_model.walk` at T = 0) is about twenty small device ops: the hidden
projection, two codebook lookups, the pair product, an argmax and log2(K) gathers. Each
is a few microseconds of GPU work but a launch from Python, so on CUDA the eager walk
cost a DFlash2 cycle ~440 µs of host time on the H200 (docs/BENCHMARKS.md, 2026-12-04),
more than a demo target step. `GreedyWalkGraphs` runs the same code (`pair_scores`,
`greedy_walk`) on static buffers: a call copies the candidates in, replays the graph of
its row count and copies the drafts out.

The drafter node owns it (it owns the selector's weights and the CUDA-graph switch) and
hands it to the selector node on its candidates; `capture=False` runs the same step
eagerly (CPU tests).
"""

from __future__ import annotations

import torch

from draftflow.layers.graphs import GraphCache
from draftflow.plugins.dflash.dflash2_model import CandidateSelector, greedy_walk, pair_scores


class GreedyWalkGraphs:
    """``graphs(ids, scores, hidden, anchor)``: the greedy walk of one request's `k` <= `rows` draft rows."""

    def __init__(self, selector: CandidateSelector, rows: int, top_k: int, hidden_size: int, dtype: torch.dtype,
                 device, *, capture: bool = True) -> None:
        self.selector, self.rows = selector, rows
        self.ids = torch.zeros(1, rows, top_k, dtype=torch.long, device=device)  # [1, K, M]
        self.scores = torch.zeros(1, rows, top_k, dtype=torch.float32, device=device)  # [1, K, M]
        self.hidden = torch.zeros(1, rows, hidden_size, dtype=dtype, device=device)  # [1, K, H]
        self.anchor = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.drafts = torch.zeros(1, rows, dtype=torch.long, device=device)  # [1, K]
        self.graphs = GraphCache(self._run, capture, device)

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor, hidden: torch.Tensor, anchor: int) -> torch.Tensor:
        """The drafts ([1, k], a new tensor) of candidates ids/scores [1, k, M] and hidden states [1, k, H]."""
        k = ids.shape[1]
        if not 1 <= k <= self.rows or ids.shape[0] != 1:
            raise ValueError(f"GreedyWalkGraphs walks one request of 1..{self.rows} rows, got {tuple(ids.shape)}")
        self.ids[:, :k].copy_(ids)
        self.scores[:, :k].copy_(scores)
        self.hidden[:, :k].copy_(hidden)
        self.anchor.fill_(anchor)
        self.graphs(k)
        return self.drafts[:, :k].clone()

    def warmup(self) -> None:
        """Capture every row count's graph now (at load), so no request captures one."""
        if self.graphs.capture:
            for k in range(1, self.rows + 1):
                self.graphs.prepare(k)

    def _run(self, k: int) -> None:
        ids = self.ids[:, :k]
        scores = pair_scores(self.selector, ids, self.scores[:, :k], self.hidden[:, :k], self.anchor)  # [1, k, M, M]
        self.drafts[:, :k].copy_(greedy_walk(scores, ids))
