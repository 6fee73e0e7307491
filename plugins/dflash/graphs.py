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

The math is `DFlashModel.add_context` followed by `DFlashModel.forward`, op for op
(DFlash2's convolution slots included), so float32 results agree with the eager node to
rounding (tests/plugins/dflash/test_dflash_graph_runner.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftflow.plugins.dflash.config import DFlashConfig
from draftflow.plugins.dflash.model import DFlashModel, draft_logits
from draftflow.layers.attention import attend_prefix, bucket_for
from draftflow.layers.graphs import GraphCache
from draftflow.layers.kv_cache import KVCache
from draftflow.layers.rope import rope_tables, rotate


def _visible(cfg: DFlashConfig, layer: int, block_pos: torch.Tensor, bucket: int) -> torch.Tensor:
    """Which of the first `bucket` keys each block row sees: the context and the block (causally / windowed per layer)."""
    # block_pos: [W] absolute positions of the block rows; returns [W, bucket] bool
    key = torch.arange(bucket, device=block_pos.device)[None, :]  # [1, S]
    query = block_pos[:, None]  # [W, 1]
    visible = (key <= block_pos[-1]).expand(block_pos.shape[0], bucket)  # every cell up to the block's last row
    if cfg.layer_is_causal(layer):
        visible = visible & (key <= query)
    if cfg.layer_type(layer) == "sliding_attention":
        visible = visible & (query - key < cfg.sliding_window)
        if not cfg.layer_is_causal(layer):
            visible = visible & (key - query < cfg.sliding_window)
    return visible


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
        bucket = bucket_for(end, self.cache.capacity, self.min_bucket)
        self.graphs(w, bucket)
        self.cache.commit(start + c)  # the context now ends where the block began
        return self.hidden[:, :w - 1], self.logits[:, :w - 1]

    def _step(self, w: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        m, cfg, kv = self.model, self.cfg, self.cache.buffer
        arange = torch.arange(w, device=self.block.device)
        ctx_pos = self.start + arange  # [W]; rows >= C are overwritten by the block below
        ctx = m.hidden_norm(m.fc(self.features[:, :w]))  # [1, W, H]
        cos, sin = rope_tables(m.inv_freq, ctx_pos, ctx.dtype)
        for i, layer in enumerate(m.layers):
            k, v = layer.self_attn.keys_values(ctx, cos, sin)
            kv[i, 0].index_copy_(1, ctx_pos, k)
            kv[i, 1].index_copy_(1, ctx_pos, v)

        pos = self.start + self.num_new + arange  # [W] block positions
        x = F.embedding(self.block[:, :w], self.embed)  # [1, W, H]
        if cfg.input_embedding_scale != 1.0:
            x = x * cfg.input_embedding_scale
        cos, sin = rope_tables(m.inv_freq, pos, x.dtype)
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            h, attn_state = layer.input_layernorm(x), None
            if layer.attention_conv is not None:
                h, attn_state = layer.attention_conv.prepare(h)
            q = rotate(attn.q_norm(attn.q_proj(h).view(1, w, attn.num_heads, attn.head_dim)), cos, sin)
            k, v = attn.keys_values(h, cos, sin)
            kv[i, 0].index_copy_(1, pos, k)
            kv[i, 1].index_copy_(1, pos, v)
            groups = attn.num_heads // attn.num_kv_heads
            visible = _visible(cfg, i, pos, bucket)  # [W, S]
            mask = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, float("-inf"))
            folded = q.view(1, w, attn.num_kv_heads, groups, attn.head_dim).permute(0, 2, 3, 1, 4)
            folded = folded.reshape(1, attn.num_kv_heads, groups * w, attn.head_dim)  # [1, KVH, G*W, D]
            out = attend_prefix(folded, kv[i, 0, :, :bucket], kv[i, 1, :, :bucket], mask.repeat(groups, 1), w)
            x = layer.finish(x, attn.o_proj(out), attn_state)
        hidden = m.norm(x)[:, 1:]  # [1, W-1, H]
        return hidden, draft_logits(hidden, self.head, cfg)

    def _run(self, w: int, bucket: int) -> None:
        hidden, logits = self._step(w, bucket)
        self.hidden[:, :w - 1].copy_(hidden)
        self.logits[:, :w - 1].copy_(logits)
