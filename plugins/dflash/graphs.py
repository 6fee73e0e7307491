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

A batch of request slots (`propose`) works the same way on B rows at once: each slot
ingests its own new rows at its own start (always `width` rows projected, the stale ones
past the slot's context) and drafts a block right after them, each row's block length set
by its mask; graphs are keyed by (batch bucket, block width, KV bucket), the batch bucket
being the next power of two of B (the rows past B are pad rows: they write only cells
past their slot's committed context). B = 1 keeps its own path, key (1, width, bucket).

There is no second implementation: a replay runs `DFlashModel.forward`, the eager node's
forward, with positions and masks built on the device (`DFlashModel.cache_window`), so
float32 results agree with the eager node to rounding
(tests/plugins/dflash/test_dflash_draft_runner.py). `warmup` captures the graphs of the
first buckets at load (the node's `Node.warmup`), so a first request captures nothing.
"""

from __future__ import annotations

import torch

from draftflow.plugin import CacheCapacityError
from draftflow.layers.attention import bucket_for
from draftflow.layers.graphs import GraphCache
from draftflow.layers.kv_cache import KVCache
from draftflow.plugins.dflash.model import DFlashModel, draft_logits

# Buckets `warmup` captures: every one up to this many cells (or the cache's capacity), as the target node's warm-up
# captures its windows' buckets up to 2048 tokens; a longer request captures its next bucket once, on first use. With
# two buckets only (before 2026-12-07) a prompt past 512 tokens captured mid-request, and on a machine's first run
# Triton compiled the block path's kernels for that bucket inside the timed request.
WARMUP_TOKENS = 2048


def warmup_buckets(width: int, capacity: int, min_bucket: int, limit: int = WARMUP_TOKENS) -> list[int]:
    """The KV buckets a proposal of `width` rows can attend, up to `limit` cells (at least the first)."""
    buckets, end = [], width
    while True:
        bucket = bucket_for(end, capacity, min_bucket)
        if bucket not in buckets:
            buckets.append(bucket)
        if bucket >= min(limit, capacity):
            return buckets
        end = bucket + 1


class DraftRunner:
    """Static-shape DFlash proposals; `capture=False` runs the same step eagerly (CPU, tests).

    Returned hidden states and logits are views of static buffers, valid until the next call.
    """

    def __init__(self, model: DFlashModel, cache: KVCache, embed: torch.Tensor, head: torch.Tensor, width: int,
                 *, capture: bool = True, min_bucket: int = 256, slots: torch.Tensor | None = None) -> None:
        # embed, head: [V, H] (the target's); width: the widest block, rows W = drafts + 1
        # cache: slot 0 (the B = 1 path); slots: every slot's rows [L, 2, max_batch, capacity, KVH, D] (default: cache's)
        if cache.mode != "static":
            raise ValueError("DraftRunner needs a static draft cache: graphs cannot follow a growing buffer")
        cfg = model.config
        device, dtype = embed.device, embed.dtype
        self.model, self.cache, self.embed, self.head, self.cfg = model, cache, embed, head, cfg
        self.width, self.capture, self.min_bucket = width, capture, min_bucket
        self.slots = cache.buffer if slots is None else slots
        self.max_batch = self.slots.shape[2]
        self.batch_inputs = None  # the batched path's static buffers, allocated at its first use (_BatchInputs)
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
        self.graphs(1, w, bucket_for(end, self.cache.capacity, self.min_bucket))
        self.cache.commit(start + c)  # the context now ends where the block began
        return self.hidden[:, :w - 1], self.logits[:, :w - 1]

    def warmup(self) -> list[tuple[int, int]]:
        """Capture the full-width graphs of the buckets up to `WARMUP_TOKENS` now (at load), not in a request.

        Capture runs the step on the static inputs as they are (zeros): it writes draft-cache
        cells past the committed length only, which every request rewrites before reading.
        Returns the (1, width, bucket) keys captured.
        """
        if not self.capture:
            return []
        keys = [(1, self.width, b) for b in warmup_buckets(self.width, self.cache.capacity, self.min_bucket)]
        for key in keys:
            self.graphs.prepare(*key)
        return keys

    def batch_size(self, n: int) -> int:
        """The batch bucket of `n` rows: the next power of two, capped at the slots there are."""
        size = 1
        while size < n:
            size *= 2
        return min(size, self.max_batch)

    def propose(self, rows: list, starts: list[int], anchors: list[int], lasts: list[int], width: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot b ingests ``rows[b]`` at ``starts[b]`` and drafts a `width`-row block anchored at ``anchors[b]``
        right after them, seeing the cells up to ``lasts[b]``; slot b's context length is the caller's to commit.

        One entry per slot of the batch bucket (``batch_size``): pad slots pass rows None, their
        committed length as start and any token. Returns views of static outputs, valid until
        the next call.
        """
        # rows[b]: [1, C_b, n*H] with C_b <= self.width, or None; returns hidden [B, W-1, H], logits [B, W-1, V]
        nb, c = len(rows), self.width
        if not 2 <= width <= self.width or not 2 <= nb <= self.max_batch:
            raise ValueError(f"DraftRunner.propose drafts 2..{self.max_batch} slots of 2..{self.width} rows, "
                             f"got {nb} of {width}")
        counts = [0 if r is None else r.shape[1] for r in rows]
        if max(counts) > c:
            raise ValueError(f"DraftRunner ingests 1..{c} rows per slot, got {max(counts)}")
        end = max(max(s + c, s + n + width) for s, n in zip(starts, counts))  # one past the last cell written
        capacity = self.slots.shape[3]
        if end > capacity:
            raise CacheCapacityError(f"draft cache needs {end} positions but holds {capacity}; raise the cache "
                                     "capacity or shorten prompt + max_new_tokens")
        if self.batch_inputs is None:
            self.batch_inputs = _BatchInputs(self)
        inp = self.batch_inputs
        flat = [b * c + j for b, n in enumerate(counts) for j in range(n)]  # feature rows into [max_batch * W]
        host = torch.tensor(starts + counts + lasts + anchors + flat, dtype=torch.long)
        meta = host.to(self.embed.device, non_blocking=True)  # the call's one host-to-device copy
        inp.meta[:, :nb].copy_(meta[:4 * nb].view(4, nb))
        if flat:
            new = torch.cat([r[0] for r in rows if r is not None])  # [sum C_b, n*H]
            inp.features.view(-1, inp.features.shape[-1]).index_copy_(0, meta[4 * nb:], new)
        self.graphs(nb, width, bucket_for(end, capacity, self.min_bucket))
        return inp.hidden[:nb, :width - 1], inp.logits[:nb, :width - 1]

    def _run(self, nb: int, w: int, bucket: int) -> None:
        if nb > 1:
            self._run_slots(nb, w, bucket)
            return
        self._run_one(w, bucket)

    def _run_slots(self, nb: int, w: int, bucket: int) -> None:
        """`draft_slots` on the static batch inputs: `width` context rows per slot (rows >= C_b stale), then the
        block; hidden states and logits into static outputs."""
        m, inp = self.model, self.batch_inputs
        start, num_new, last, anchor = inp.meta[:, :nb]  # [B] each
        tokens = torch.cat([anchor[:, None], inp.masks[:nb, :w - 1]], dim=1)  # [B, W]: [anchor, MASK...]
        x = m.embed_block(tokens, self.embed)  # [B, W, H]
        hidden = m.draft_slots(inp.features[:nb], x, start, num_new, last, self.slots[:, :, :nb], bucket)[:, 1:]
        inp.hidden[:nb, :w - 1].copy_(hidden)
        inp.logits[:nb, :w - 1].copy_(draft_logits(hidden, self.head, self.cfg))

    def _run_one(self, w: int, bucket: int) -> None:
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


class _BatchInputs:
    """Static inputs and outputs of the batched proposal, sized for every slot (allocated at its first use)."""

    def __init__(self, runner: DraftRunner) -> None:
        cfg, embed, b, w = runner.cfg, runner.embed, runner.max_batch, runner.width
        device, dtype = embed.device, embed.dtype
        self.features = torch.zeros(b, w, cfg.num_taps * cfg.hidden_size, dtype=dtype, device=device)  # [B, W, n*H]
        self.meta = torch.zeros(4, b, dtype=torch.long, device=device)  # start, num_new, last, anchor per slot
        self.masks = torch.full((b, w - 1), cfg.mask_token_id, dtype=torch.long, device=device)  # [B, W-1]
        self.hidden = torch.zeros(b, w - 1, cfg.hidden_size, dtype=dtype, device=device)  # [B, W-1, H]
        self.logits = torch.zeros(b, w - 1, runner.head.shape[0], dtype=torch.float32, device=device)  # [B, W-1, V]
