"""One DFlash proposal (feature ingest + block forward + LM head) as a CUDA graph per (width, KV bucket).

A cycle's proposal ingests the C feature rows the last commit added (C = accepted + 1,
so 1..W) and then runs the W-row block `[anchor, MASK x (W-1)]` right after them. To keep
every shape fixed, ingest always projects W rows from a static input buffer: rows past C
hold stale values whose K/V land at positions start+C .. start+W-1, and the block, which
starts at start+C, overwrites every one of those cells before any query reads them.
Positions and the block start live in device tensors, attention reads a fixed cache
prefix (a bucket, as in the target's graphs) with later keys masked, so one graph per
bucket serves every cycle of a width (the width shrinks only near `max_new_tokens`) and a
replay needs no Python and no host synchronisation.

There is no second implementation: a replay runs `DFlashModel.forward`, the eager node's
forward, with positions and masks built on the device (`DFlashModel.cache_window`), so
float32 results agree with the eager node to rounding
(tests/plugins/dflash/test_dflash_draft_runner.py). `warmup` captures the graphs of the
first buckets at load (the node's `Node.warmup`), so a first request captures nothing.
"""

from __future__ import annotations

import torch

from draftflow.layers.attention import bucket_for
from draftflow.layers.graphs import GraphCache
from draftflow.layers.kv_cache import KVCache
from draftflow.plugins.dflash.model import DFlashModel, draft_logits

# Buckets `warmup` captures per width: the first two cover prompt + output up to 2 * MIN_BUCKET
# tokens (512 by default); longer requests capture their next bucket once, on first use.
WARMUP_BUCKETS = 2


class DraftRunner:
    """Static-shape DFlash proposals; `capture=False` runs the same step eagerly (CPU, tests).

    Returned hidden states and logits are views of static buffers, valid until the next call.
    """

    def __init__(self, model: DFlashModel, cache: KVCache, embed: torch.Tensor, head: torch.Tensor, width: int,
                 *, capture: bool = True, min_bucket: int = 256) -> None:
        # embed, head: [V, H] (the target's); width: the widest block, rows W = drafts + 1
        if cache.mode != "static":
            raise ValueError("DraftRunner needs a static draft cache: graphs cannot follow a growing buffer")
        cfg = model.config
        device, dtype = embed.device, embed.dtype
        self.model, self.cache, self.embed, self.head, self.cfg = model, cache, embed, head, cfg
        self.width, self.capture, self.min_bucket = width, capture, min_bucket
        self.features = torch.zeros(1, width, cfg.num_taps * cfg.hidden_size, dtype=dtype, device=device)  # [1, W, n*H]
        self.block = torch.full((1, width), cfg.mask_token_id, dtype=torch.long, device=device)  # [1, W]
        self.start = torch.zeros(1, dtype=torch.long, device=device)  # first new context row
        self.num_new = torch.zeros(1, dtype=torch.long, device=device)  # C
        self.rows = torch.arange(width, device=device)  # [W]
        self.hidden = torch.zeros(1, width - 1, cfg.hidden_size, dtype=dtype, device=device)  # [1, W-1, H]
        self.logits = torch.zeros(1, width - 1, head.shape[0], dtype=torch.float32, device=device)  # [1, W-1, V]
        self.graphs = GraphCache(self._run, capture, device)

    def __call__(self, rows: torch.Tensor, start: int, anchor: int, width: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ingest `rows` at `start`, then draft a `width`-row block anchored at start + C; return (hidden, logits)."""
        # rows: [1, C, n*H] with 1 <= C <= W; returns hidden [1, W-1, H], logits [1, W-1, V] float32
        w = self.width if width is None else width
        c = rows.shape[1]
        if not 2 <= w <= self.width:
            raise ValueError(f"DraftRunner drafts blocks of 2..{self.width} rows, got {w}")
        if not 1 <= c <= w:
            raise ValueError(f"DraftRunner ingests 1..{w} rows per proposal of width {w}, got {c}")
        end = start + c + w  # one past the block's last row
        self.cache.ensure(end)
        self.features[:, :c].copy_(rows)
        self.block[:, :1].fill_(anchor)
        self.start.fill_(start)
        self.num_new.fill_(c)
        self.graphs(w, bucket_for(end, self.cache.capacity, self.min_bucket))
        self.cache.commit(start + c)  # the context now ends where the block began
        return self.hidden[:, :w - 1], self.logits[:, :w - 1]

    def warmup(self) -> list[tuple[int, int]]:
        """Capture the full-width graphs of the first `WARMUP_BUCKETS` buckets now (at load), not in a request.

        Capture runs the step on the static inputs as they are (zeros): it writes draft-cache
        cells past the committed length only, which every request rewrites before reading.
        Returns the (width, bucket) keys captured.
        """
        if not self.capture:
            return []
        keys, end = [], self.width
        for _ in range(WARMUP_BUCKETS):
            bucket = bucket_for(end, self.cache.capacity, self.min_bucket)
            if (self.width, bucket) not in keys:
                keys.append((self.width, bucket))
            end = bucket + 1
        for key in keys:
            self.graphs.prepare(*key)
        return keys

    def _run(self, w: int, bucket: int) -> None:
        """The model's one forward on the static inputs: W context rows (rows >= C are stale, and overwritten
        by the block, which starts at start + C), then the block; hidden states and logits into static outputs."""
        m, rows = self.model, self.rows[:w]
        context_pos = self.start + rows  # [W]
        block_pos = context_pos + self.num_new  # [W]
        window = m.cache_window(context_pos, block_pos, bucket, self.embed.dtype)
        x = m.embed_block(self.block[:, :w], self.embed)  # [1, W, H]
        hidden = m(self.features[:, :w], x, window, self.cache.buffer)[:, 1:]  # [1, W-1, H]
        self.hidden[:, :w - 1].copy_(hidden)
        self.logits[:, :w - 1].copy_(draft_logits(hidden, self.head, self.cfg))
