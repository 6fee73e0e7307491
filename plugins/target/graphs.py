"""Target decode/verify windows as CUDA graphs: static input buffers around the model's one forward.

A window of W tokens per row starts at positions that change every cycle. The runner keeps
the tokens and the starts in device buffers and calls `TargetModel.forward` with the starts
as a device tensor and an attention *bucket* (`attention.bucket_for`), so shapes depend only
on (batch bucket, W, KV bucket); `layers.graphs.GraphCache` captures one graph per key on
first use (or at warm-up, `prepare`) and replays it with no Python and no host
synchronisation. A batch of n rows runs the graph of the smallest batch bucket >= n
(`BATCH_BUCKETS`, capped at the cache's rows); rows n.. of the bucket are pad rows that
start at their slot's committed length, so they write only past it. Batch bucket 1 is the
single-request graph exactly as before (one start for the window, the anchor filled in
as a kernel argument). Host work stays outside the graph: the start checks, `cache.ensure`,
and for hybrid targets opening the linear-state window (`LinearState.begin`); committing
is the caller's, as with the eager forward. The feature taps are written inside the graph.

The fast paths are `fused.Kernels` options of that forward: fused q/k/v and gate/up
products (`fuse_projections`); on CUDA the Triton q/k-norm + RoPE + KV-write prologue,
split-KV attention, residual-add + RMSNorm and SiLU-gate kernels; torch.compile'd pieces
for whatever those do not cover (the hybrid's gated, partially rotated attention). Numbers and the profile are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

from draftflow.layers.attention import MIN_BUCKET, bucket_for
from draftflow.layers.fused import Kernels, fuse_projections, joined  # noqa: F401 - joined: re-exported for callers
from draftflow.layers.graphs import GraphCache
from draftflow.layers.kv_cache import KVCache
from draftflow.layers.linear_state import LinearState
from draftflow.plugins.target.model import TargetModel


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def graph_width(w: int, max_window: int) -> int:
    """Tokens per row of the graph a `w`-token window runs: the next power of two >= w, at most `max_window`.

    A verify window's width follows the drafts a cycle offers (prompt lookup's vary every cycle,
    every drafter's shrink near max_new_tokens), so one graph per width meant up to max_window
    graphs per KV bucket, most captured mid-request (H200, demo pair: 23 captures, 1.8 s, in
    the first 30 HumanEval requests). Padded, a window runs one of log2(max_window) + 2 graphs;
    the rows past `w` hold stale valid tokens, sit after every real row (causal attention: no
    real row sees them) and write K/V and taps only past the committed length, as rejected
    drafts do.
    """
    return bucket_for(w, max_window, smallest=1)


def graph_widths(max_window: int) -> list[int]:
    """Every width `graph_width` gives for windows of 1..max_window tokens, ascending."""
    return sorted({graph_width(w, max_window) for w in range(1, max_window + 1)})


def batch_bucket(n: int, max_batch: int) -> int:
    """Rows a batch of `n` runs with: the smallest of BATCH_BUCKETS >= n, capped at `max_batch` (the cache's rows)."""
    return min(next((b for b in BATCH_BUCKETS if b >= n), n), max_batch)


class GraphRunner:
    """Target windows through static buffers: one CUDA graph per (batch bucket, W, KV bucket), captured on first use.

    `capture=False` runs the same forward without graphs (CPU, tests). Returned logits
    and taps are the captured forward's outputs, valid until the next call with the same
    key. `triton` / `triton_attention` / `elementwise` default to on for CUDA (the
    prologue needs fused q/k/v and whole-head rotary; other layers take the torch ops, compiled
    when `compiled`). With all three, a dense target compiles nothing with torch.compile.
    `features` ([B, capacity, n*H]): the taps are written there at each row's positions.
    """

    def __init__(self, model: TargetModel, cache: KVCache, max_window: int, tap_layers: Sequence[int] = (), *,
                 linear: LinearState | None = None, capture: bool = True, compiled: bool = True, fused: bool = True,
                 triton: bool | None = None, triton_attention: bool | None = None, elementwise: bool | None = None,
                 min_bucket: int = MIN_BUCKET, features: torch.Tensor | None = None) -> None:
        if cache.mode != "static":
            raise ValueError("GraphRunner needs a static KV cache (kv_mode: static): graphs cannot follow a growing buffer")
        if model.config.is_hybrid and (linear is None or linear.max_window < max_window):
            raise ValueError("a hybrid target's GraphRunner needs its LinearState, recording windows of max_window tokens")
        if model.config.moe_layers:
            if model.expert_cache is None and model.host_experts is not None:
                model.set_expert_cache(None)  # every expert resident: built now, not inside a capture
            if capture and not (model.expert_cache is not None
                                and model.expert_cache.capturable(cache.buffer.shape[2] * max_window)):
                raise ValueError("this MoE target's windows need the host (expert cache without device routing, or "
                                 "batched windows past its device window, docs/MOE.md): run it eagerly")
        if fused:
            fuse_projections(model)
        kv = cache.buffer  # [L, 2, B, capacity, KVH, D]
        device, batch = kv.device, kv.shape[2]
        self.model, self.cache, self.linear, self.max_window = model, cache, linear, max_window
        self.taps, self.features = tuple(tap_layers), features
        self.capture, self.min_bucket, self.max_batch = capture, min_bucket, batch
        d = model.config.head_dim
        triton_ok = kv.is_cuda and d & (d - 1) == 0  # Triton blocks are powers of two
        self.kernels = Kernels(compiled=compiled, prologue=triton_ok and (fused if triton is None else triton),
                               split_attention=triton_ok and (True if triton_attention is None else triton_attention),
                               elementwise=kv.is_cuda and (True if elementwise is None else elementwise))
        # The same prologue and elementwise kernels for eager forwards of any length (a prompt's prefill): no
        # torch.compile (a prompt's length varies), and SDPA's causal kernel instead of the split-KV decode attention.
        # The plain ops are ~500 launches for the demo target (9 layers) over a 120-token prompt (torch.profiler).
        self.eager_kernels = Kernels(prologue=self.kernels.prologue is not None, elementwise=self.kernels.elementwise)
        self.tokens = torch.zeros(batch, max_window, dtype=torch.long, device=device)  # [B, Wmax]
        self.start = torch.zeros(1, dtype=torch.long, device=device)  # [1]: batch bucket 1
        self.starts = torch.zeros(batch, dtype=torch.long, device=device)  # [B]: per-row starts of larger buckets
        # Host staging for a batch's anchors and starts: one copy per cycle. Pinned on CUDA so the copy is
        # asynchronous; `_staged` orders the next overwrite after it.
        self._host = torch.zeros(2 * batch, dtype=torch.long, pin_memory=kv.is_cuda)  # [anchors | starts] of nb rows
        self._device = torch.zeros(2 * batch, dtype=torch.long, device=device)
        self._staged = torch.cuda.Event() if kv.is_cuda else None
        self.outputs: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.capture_s: dict[tuple[int, int, int], float] = {}  # seconds per graph captured by `prepare`
        self.graphs = GraphCache(self._run, capture, device)

    def __call__(self, anchor: int, drafts: torch.Tensor | None, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the window [anchor, *drafts] at `start` in row 0; return (logits [1, W, V] float32, taps [1, W, n*H] or None)."""
        # drafts: [1, K] int64 on the device, or None
        w = self._width(drafts)
        g = graph_width(w, self.max_window)
        self._check(0, start, g)
        self.cache.ensure(start + g)
        if self.linear is not None:
            self.linear.rows(0, 1).begin(start, g)
        # The anchor and start go in as kernel arguments: no host-to-device copy, no sync.
        self.tokens[:1, :1].fill_(anchor)
        if w > 1:
            self.tokens[:1, 1:w].copy_(drafts)
        self.start.fill_(start)
        key = (1, g, bucket_for(start + g, self.cache.capacity, self.min_bucket))
        self._rebalance()
        self.graphs(*key)
        logits, taps = self.outputs[key]
        return logits[:, :w], (taps[:, :w] if taps is not None else None)

    def step(self, anchors: list[int], drafts: torch.Tensor | None, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run row b's window [anchors[b], *drafts[b]] at starts[b] for the n = len(anchors) first cache rows.

        Returns (logits [n, W, V] float32, taps [n, W, n_taps*H] or None), views of the graph's
        outputs. n = 1 is `__call__`. Rows past n up to the batch bucket run as pad rows at their
        committed lengths. A caller's pad row is any valid anchor at its row's committed length.
        """
        # drafts: [n, K] int64 on the device, or None
        n = len(anchors)
        if n == 1:
            return self(anchors[0], drafts, starts[0])
        w = self._width(drafts)
        g = graph_width(w, self.max_window)
        nb = batch_bucket(n, self.max_batch)
        lengths = self.cache.lengths
        starts = list(starts) + lengths[n:nb]
        for row in range(n):
            self._check(row, starts[row], g)
        self.cache.ensure(max(starts) + g)
        if self.linear is not None:
            self.linear.rows(0, nb).begin(starts, g)
        if self._staged is not None:
            self._staged.synchronize()  # the last batch's copy has left the staging buffer (done by the cycle's sync)
        self._host[:2 * nb] = torch.tensor(anchors + [0] * (nb - n) + starts)
        staged = self._device[:2 * nb]
        staged.copy_(self._host[:2 * nb], non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        self.tokens[:nb, 0].copy_(staged[:nb])
        if w > 1:
            self.tokens[:n, 1:w].copy_(drafts)
        self.starts[:nb].copy_(staged[nb:])
        key = (nb, g, bucket_for(max(starts) + g, self.cache.capacity, self.min_bucket))
        self._rebalance()
        self.graphs(*key)
        logits, taps = self.outputs[key]
        return logits[:n, :w], (taps[:n, :w] if taps is not None else None)

    def _rebalance(self) -> None:
        if self.model.expert_cache is not None:  # MoE: the last window's routing decides uploads, outside the graph
            self.model.expert_cache.rebalance()

    def _width(self, drafts: torch.Tensor | None) -> int:
        w = 1 + (drafts.shape[1] if drafts is not None else 0)
        if w > self.max_window:
            raise ValueError(f"window of {w} tokens exceeds the runner's max_window {self.max_window}")
        return w

    def _check(self, row: int, start: int, w: int) -> None:
        length = self.cache.lengths[row]
        if start > length:
            raise ValueError(
                f"forward at start_pos={start} but the KV cache holds only {length} committed positions"
                f"{f' in row {row}' if self.max_batch > 1 else ''}; commit the previous window first so attention never reads unwritten cells"
            )

    def prepare(self, widths: Iterable[int], context: int, batch: int = 1) -> list[tuple[int, int, int]]:
        """Capture (and compile) now the graphs of `widths` at batch bucket `batch` for every KV bucket up to
        `context` tokens; return their keys.

        Writes only cells past the committed lengths and uncommitted linear-state slots, so
        it leaves no request state behind. No-op keys are skipped when capture is off.
        """
        keys: list[tuple[int, int, int]] = []
        nb = batch_bucket(batch, self.max_batch)
        widths = sorted({graph_width(w, self.max_window) for w in widths if 1 <= w <= self.max_window})
        lengths = self.cache.lengths[:nb]
        if not widths or max(lengths) + widths[-1] > self.cache.capacity:
            return keys
        for w in widths:
            bucket = bucket_for(w, self.cache.capacity, self.min_bucket)
            while True:
                keys.append((nb, w, bucket))
                if bucket >= min(context, self.cache.capacity):
                    break
                bucket = bucket_for(bucket + 1, self.cache.capacity, self.min_bucket)
        if self.capture:
            self.tokens.zero_()
            self.start.fill_(lengths[0])
            self.starts[:nb].copy_(torch.tensor(lengths))
            for key in keys:
                began = time.perf_counter()
                self.graphs.prepare(*key)
                torch.cuda.synchronize()
                self.capture_s[key] = time.perf_counter() - began  # the first key of a width includes compiling
        return keys

    def _run(self, nb: int, w: int, bucket: int) -> None:
        # Under capture the outputs are allocated in the graph's pool: replays rewrite them in place.
        start = self.start if nb == 1 else self.starts[:nb]
        cache = self.cache.rows(0, nb)
        linear = self.linear.rows(0, nb) if self.linear is not None else None
        logits, taps = self.model(self.tokens[:nb, :w], start, cache, tap_layers=self.taps or None, linear=linear,
                                  bucket=bucket, kernels=self.kernels)
        if taps is not None and self.features is not None:
            rows = self.features[:nb]  # [nb, capacity, n*H]
            if nb == 1:
                rows.index_copy_(1, start + torch.arange(w, device=start.device), taps)
            else:
                positions = start[:, None] + torch.arange(w, device=start.device)  # [nb, W]
                rows.index_put_((torch.arange(nb, device=start.device)[:, None], positions), taps)
        self.outputs[(nb, w, bucket)] = (logits, taps)
