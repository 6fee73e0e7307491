"""Target decode/verify windows as CUDA graphs: static input buffers around the model's one forward.

A window of W tokens starts at a position that changes every cycle. The runner keeps the
tokens and the start in device buffers and calls `TargetModel.forward` with the start as
a device tensor and an attention *bucket* (`attention.bucket_for`), so shapes depend only
on (W, bucket); `layers.graphs.GraphCache` captures one graph per pair on first use (or at
warm-up, `prepare`) and replays it with no Python and no host synchronisation. Host work
stays outside the graph: the start check, `cache.ensure`, and for hybrid targets opening
the linear-state window (`LinearState.begin`); committing is the caller's, as with the
eager forward.

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


class GraphRunner:
    """Target windows through static buffers: one CUDA graph per (W, bucket), captured on first use.

    `capture=False` runs the same forward without graphs (CPU, tests). Returned logits
    and taps are the captured forward's outputs, valid until the next call with the same
    (W, bucket). `triton` / `triton_attention` / `elementwise` default to on for CUDA (the
    prologue needs fused q/k/v and whole-head rotary; other layers take the torch ops, compiled
    when `compiled`). With all three, a dense target compiles nothing with torch.compile.
    """

    def __init__(self, model: TargetModel, cache: KVCache, max_window: int, tap_layers: Sequence[int] = (), *,
                 linear: LinearState | None = None, capture: bool = True, compiled: bool = True, fused: bool = True,
                 triton: bool | None = None, triton_attention: bool | None = None, elementwise: bool | None = None,
                 min_bucket: int = MIN_BUCKET) -> None:
        if cache.mode != "static":
            raise ValueError("GraphRunner needs a static KV cache (kv_mode: static): graphs cannot follow a growing buffer")
        if model.config.is_hybrid and (linear is None or linear.max_window < max_window):
            raise ValueError("a hybrid target's GraphRunner needs its LinearState, recording windows of max_window tokens")
        if model.config.moe_layers:
            raise ValueError("MoE targets run eagerly: expert uploads are host decisions made per window")
        if fused:
            fuse_projections(model)
        kv = cache.buffer  # [L, 2, B, capacity, KVH, D]
        device, batch = kv.device, kv.shape[2]
        self.model, self.cache, self.linear, self.max_window = model, cache, linear, max_window
        self.taps = tuple(tap_layers)
        self.capture, self.min_bucket = capture, min_bucket
        d = model.config.head_dim
        triton_ok = kv.is_cuda and d & (d - 1) == 0  # Triton blocks are powers of two
        self.kernels = Kernels(compiled=compiled, prologue=triton_ok and (fused if triton is None else triton),
                               split_attention=triton_ok and (True if triton_attention is None else triton_attention),
                               elementwise=kv.is_cuda and (True if elementwise is None else elementwise))
        self.tokens = torch.zeros(batch, max_window, dtype=torch.long, device=device)  # [B, Wmax]
        self.start = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.capture_s: dict[tuple[int, int], float] = {}  # seconds per graph captured by `prepare`
        self.graphs = GraphCache(self._run, capture, device)

    def __call__(self, anchor: int, drafts: torch.Tensor | None, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the window [anchor, *drafts] at `start`; return (logits [B, W, V] float32, taps [B, W, n*H] or None)."""
        # drafts: [B, K] int64 on the device, or None
        w = 1 + (drafts.shape[1] if drafts is not None else 0)
        if w > self.max_window:
            raise ValueError(f"window of {w} tokens exceeds the runner's max_window {self.max_window}")
        if start > self.cache.length:
            raise ValueError(
                f"forward at start_pos={start} but the KV cache holds only {self.cache.length} committed "
                "positions; commit the previous window first so attention never reads unwritten cells"
            )
        self.cache.ensure(start + w)
        if self.linear is not None:
            self.linear.begin(start, w)
        self.tokens[:, :1].fill_(anchor)
        if w > 1:
            self.tokens[:, 1:w].copy_(drafts)
        self.start.fill_(start)
        key = (w, bucket_for(start + w, self.cache.capacity, self.min_bucket))
        self.graphs(*key)
        return self.outputs[key]

    def prepare(self, widths: Iterable[int], context: int) -> list[tuple[int, int]]:
        """Capture (and compile) now the graphs of `widths` for every bucket up to `context` tokens; return their keys.

        Writes only cells past the committed length and uncommitted linear-state slots, so
        it leaves no request state behind. No-op keys are skipped when capture is off.
        """
        keys: list[tuple[int, int]] = []
        widths = sorted({w for w in widths if 1 <= w <= self.max_window})
        if not widths or self.cache.length + widths[-1] > self.cache.capacity:
            return keys
        for w in widths:
            bucket = bucket_for(w, self.cache.capacity, self.min_bucket)
            while True:
                keys.append((w, bucket))
                if bucket >= min(context, self.cache.capacity):
                    break
                bucket = bucket_for(bucket + 1, self.cache.capacity, self.min_bucket)
        if self.capture:
            self.tokens.zero_()
            self.start.fill_(self.cache.length)
            for key in keys:
                began = time.perf_counter()
                self.graphs.prepare(*key)
                torch.cuda.synchronize()
                self.capture_s[key] = time.perf_counter() - began  # the first key of a width includes compiling
        return keys

    def _run(self, w: int, bucket: int) -> None:
        # Under capture the outputs are allocated in the graph's pool: replays rewrite them in place.
        self.outputs[(w, bucket)] = self.model(self.tokens[:, :w], self.start, self.cache, tap_layers=self.taps or None,
                                               linear=self.linear, bucket=bucket, kernels=self.kernels)
