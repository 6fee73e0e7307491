"""The one CUDA-graph runner: replay a static-shape step as one graph per key, captured on first use.

A model's captured forward writes into static output buffers and reads static input
buffers; its shapes depend only on a small key (window width, attention bucket). The
target and every drafter wrap their step in a `GraphCache`: the first call for a key runs
the step a few times on a side stream (compilation, cuBLAS and attention workspaces), then
captures it; later calls replay it with no Python and no host synchronisation.
`capture=False` runs the step eagerly (CPU, tests): the same code either way.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Hashable

import torch
from torch.nn.attention import sdpa_kernel

from draftflow.layers.attention import BACKENDS

WARMUP_RUNS = 2  # eager runs on a side stream before capture


class GraphCache:
    """``cache(*key)`` runs ``step(*key)``: eagerly, or by replaying the key's CUDA graph (captured on first use).

    All graphs of one cache share one memory pool. ``step`` must only write static buffers
    and must be safe to run again with the same inputs (warm-up runs precede capture).
    """

    def __init__(self, step: Callable[..., None], capture: bool, device: torch.device | str) -> None:
        self.step, self.capture = step, capture
        self.cuda = torch.device(device).type == "cuda"  # pin the masked SDPA kernels there (attention.BACKENDS)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def __call__(self, *key: Hashable) -> None:
        if not self.capture:
            self._run(key)
            return
        graph = self.graphs.get(key)
        (graph if graph is not None else self.prepare(*key)).replay()

    def __contains__(self, key: tuple) -> bool:
        return key in self.graphs

    def __iter__(self):
        return iter(self.graphs)

    def __len__(self) -> int:
        return len(self.graphs)

    def get(self, key: tuple):
        return self.graphs.get(key)

    def _run(self, key: tuple) -> None:
        with sdpa_kernel(BACKENDS) if self.cuda else nullcontext():
            self.step(*key)

    def prepare(self, *key: Hashable) -> torch.cuda.CUDAGraph:
        """Capture the graph for `key` now (warm-up at load), without replaying it."""
        if key in self.graphs:
            return self.graphs[key]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._run(key)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._run(key)
        self.graphs[key] = graph
        return graph
