"""The DFlash block drafter: Qwen3 layers whose keys/values see projected target features.

A forward drafts a whole block: the input is the target's embedding of
`[anchor, MASK x (W-1)]` and every block row attends to the *context* (keys and values
projected from the committed tokens' feature taps) plus the block itself — non-causally
in full-attention layers, as the drafter was trained. Context K/V are computed once per
committed token and kept in a position-addressed cache; the block's own K/V are written
past the committed length and dropped by the next `crop`, so nothing is ever copied.

There is one forward (`DFlashModel.forward`). It ingests the new context rows and runs the
block in the same pass, and everything that varies from call to call arrives as
device-side metadata (a `Window`: positions, masks, how many cache cells are attended):

- eager inference (`draft`, the CPU and `cuda_graphs: false` path): positions from ints,
  attention over exactly the written cache prefix;
- CUDA graphs (`graphs.DraftRunner`): positions in static device tensors, attention over a
  fixed prefix (a bucket) with later keys masked, so one capture serves every cycle;
- a batch of request slots (`draft_slots`, eager or under a graph): every row at its own
  positions in its own slot of the cache, its own block length expressed by its mask;
- training (`tools/train/dflash_recipe.py`): many blocks per sequence, no cache (`kv=None`:
  keys are the context rows then the block rows), the recipe's context/block mask.

Module names equal the z-lab checkpoint names, so loading is `load_state_dict`.
The embedding and LM head are not part of the drafter: callers pass the target's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.layers import cpu_linear
from draftflow.layers.attention import attend_prefix
from draftflow.layers.decoder import MLP
from draftflow.layers.fused import PLAIN, Kernels, fuse_projections, fused_linear
from draftflow.layers.kv_cache import KVCache
from draftflow.layers.norm import RMSNorm
from draftflow.layers.rope import rope_inv_freq, rope_tables, rotate
from draftflow.plugins.dflash.config import DFlashConfig


class Window(NamedTuple):
    """Device-side metadata of one forward: where its rows sit and which keys each block row sees."""

    context_pos: torch.Tensor  # [C] or [B, C] int64 positions of the context rows (= their cache cells)
    block_pos: torch.Tensor  # [W'] or [B, W'] int64 positions of the block rows (cache cells at inference)
    masks: list  # per draft layer: [..., G*W', S] (bool, or additive float) in attend_prefix's folded row order; None: all
    keys: int  # S: cache cells attended (a bucket under CUDA graphs); training: C + W'
    width: int  # rows per block; W' = N * width when the window holds N blocks (training)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        kw = {"dtype": dtype, "device": device, "bias": False}
        self.q_proj = cpu_linear.Linear(h, cfg.num_heads * d, **kw)
        self.k_proj = cpu_linear.Linear(h, cfg.num_kv_heads * d, **kw)
        self.v_proj = cpu_linear.Linear(h, cfg.num_kv_heads * d, **kw)
        self.o_proj = cpu_linear.Linear(cfg.num_heads * d, h, **kw)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated, normed keys and values of `x` (context or block rows)."""
        # x: [B, T, H]; cos, sin: [T, 1, D] or [B, T, 1, D]; returns k, v: [B, T, KVH, D]
        b, t, _ = x.shape
        kv = fused_linear(x, [self.k_proj, self.v_proj], cpu_linear.linear)  # one product once fused (the nodes fuse)
        k, v = kv.chunk(2, dim=-1) if kv is not None else (self.k_proj(x), self.v_proj(x))
        k = self.k_norm(k.reshape(b, t, self.num_kv_heads, self.head_dim))
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
        return rotate(k, cos, sin), v

    def folded_queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotated, normed queries, each KV head's query group folded into the rows (attend_prefix's layout)."""
        # x: [B, W, H]; returns [B, KVH, G*W, D] (row g*W + w)
        b, w, _ = x.shape
        q = rotate(self.q_norm(self.q_proj(x).view(b, w, self.num_heads, self.head_dim)), cos, sin)
        g = self.num_heads // self.num_kv_heads
        q = q.view(b, w, self.num_kv_heads, g, self.head_dim).permute(0, 2, 3, 1, 4)
        return q.reshape(b, self.num_kv_heads, g * w, self.head_dim)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = DFlashAttention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)
        # Optional sublayer wrappers (DFlash2's dynamic convolutions): an object with
        # `prepare(u) -> (u', state)` applied to the normed sublayer input and
        # `finish(y, state) -> y'` applied to the sublayer output before the residual add,
        # both over the rows of one block ([blocks, width, H]).
        self.attention_conv = None
        self.mlp_conv = None


class DFlashModel(nn.Module):
    """Drafter weights and the one forward (context ingest + block), with its metadata builders."""

    def __init__(self, cfg: DFlashConfig, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = cpu_linear.Linear(cfg.num_taps * h, h, bias=False, dtype=dtype, device=device)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.layers = nn.ModuleList(DFlashLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        # rope_inv_freq reads head_dim, rope_theta and rope_scaling only, which DFlashConfig has.
        # On a real device the RoPE table goes there now; on meta it stays on the CPU until `.to(device)`.
        inv_freq = rope_inv_freq(cfg)
        if device is not None and torch.device(device).type != "meta":
            inv_freq = inv_freq.to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.requires_grad_(False)
        self.kernels: Kernels = PLAIN  # `use_triton`: the Triton pieces of the block path (`_forward_triton`)

    def use_triton(self) -> bool:
        """Run inference blocks of one request (a cache, shared positions) through `_forward_triton`, when every
        layer is non-causal (DFlash's, z-lab's b16 drafters), full or sliding with a window of at least the block,
        and heads are a power of two; q/k/v and gate/up weights go back to back (`fuse_projections`). Returns
        whether it took. On the CPU the kernels run through Triton's interpreter (tests); the DFlash nodes call it
        on CUDA."""
        cfg, d = self.config, self.config.head_dim
        ok = all(not cfg.layer_is_causal(i) and (cfg.layer_span(i) or cfg.block_size) >= cfg.block_size
                 for i in range(cfg.num_layers))
        if not ok or d & (d - 1) or 2 * self.inv_freq.numel() != d:  # (no partial rotary in the kernel)
            return False
        fuse_projections(self)
        self.kernels = Kernels(split_attention=True, elementwise=True)
        return True

    def forward(self, features: torch.Tensor, block: torch.Tensor | None, window: Window,
                kv: torch.Tensor | None = None) -> torch.Tensor | None:
        """Project the context rows' features into every layer's K/V, then run the block; return normed hidden states.

        With a cache (`kv`), context K/V are written at `window.context_pos` and block K/V at
        `window.block_pos` (shared by the rows, or per row: `draft_slots`), and attention reads the first `window.keys` cells. Without one
        (training) the keys are the context rows followed by the block rows. `block=None`
        only ingests the context (a long prompt, in chunks).
        """
        # features: [B, C, n_taps*H]; block: [B, W', H] (target embeddings of [anchor, MASK...], scaled)
        # kv: [L, 2, B, capacity, KVH, D] or None; returns [B, W', H] or None
        ctx = self.hidden_norm(self.fc(features))  # [B, C, H]; shared by all layers, never input-normed
        x, c = block, ctx.shape[1]
        # With a block, the context and block rows share each layer's k/v projections: one [C+W', H] product
        # each instead of two small ones (on CUDA, fp32 [16, H] x [H, KVH*D] products hit a slow cuBLAS kernel).
        positions = window.context_pos if x is None else _joined(window.context_pos, window.block_pos)
        if x is not None and kv is not None and self.kernels.split_attention is not None \
                and window.context_pos.dim() == 1 and kv.shape[2] == 1:
            return self._forward_triton(ctx, x, window, kv, positions)
        cos, sin = self._rope(positions, ctx.dtype)  # [T, 1, D] or [B, T, 1, D]: the context rows, then the block's
        cos_b, sin_b = cos[..., c:, :, :], sin[..., c:, :, :]
        ctx_cells = blk_cells = None  # per-row positions ([B, T]): flat cell indices, computed once
        if kv is not None and window.context_pos.dim() == 2:
            ctx_cells, blk_cells = _flat_cells(window.context_pos, kv), _flat_cells(window.block_pos, kv)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if x is None:  # ingest only
                k_ctx, v_ctx = attn.keys_values(ctx, cos, sin)  # [B, C, KVH, D]
                _store(kv[i, 0], window.context_pos, ctx_cells, k_ctx)
                _store(kv[i, 1], window.context_pos, ctx_cells, v_ctx)
                continue
            h, attn_state = _prepare(layer.attention_conv, layer.input_layernorm(x), window.width)
            keys, values = attn.keys_values(torch.cat([ctx, h], 1), cos, sin)  # [B, C+W', KVH, D]
            if kv is not None:  # the context's cells first: the block overwrites any stale context row after it
                _store(kv[i, 0], window.context_pos, ctx_cells, keys[:, :c])
                _store(kv[i, 1], window.context_pos, ctx_cells, values[:, :c])
                _store(kv[i, 0], window.block_pos, blk_cells, keys[:, c:])
                _store(kv[i, 1], window.block_pos, blk_cells, values[:, c:])
                keys, values = kv[i, 0, :, :window.keys], kv[i, 1, :, :window.keys]  # [B, S, KVH, D]
            out = attend_prefix(attn.folded_queries(h, cos_b, sin_b), keys, values, window.masks[i], h.shape[1])
            x = x + _finish(layer.attention_conv, attn.o_proj(out), attn_state)
            u, mlp_state = _prepare(layer.mlp_conv, layer.post_attention_layernorm(x), window.width)
            x = x + _finish(layer.mlp_conv, layer.mlp(u), mlp_state)
        return None if x is None else self.norm(x)

    def _forward_triton(self, ctx: torch.Tensor, x: torch.Tensor, window: Window, kv: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:
        """`forward`'s block path after `use_triton` (B = 1): per layer one q/k/v product over the context and block
        rows, one kernel for q/k-norm + RoPE (its tables too) + every K/V write, split-KV attention over the cache
        prefix (no mask: the block sees every cell before its end), residual add + RMSNorm and the SiLU gate as
        Triton kernels. About eleven launches a layer where the plain ops take about thirty (counted from the
        code; docs/DFLASH.md)."""
        # ctx: [1, C, H]; x: [1, W, H]; positions: [C+W]; returns [1, W, H]
        from draftflow.layers import triton_kernels as tk

        k, c = self.kernels, ctx.shape[1]
        u = self.layers[0].input_layernorm(x)
        for i, layer in enumerate(self.layers):
            attn, post = layer.self_attn, layer.post_attention_layernorm
            h, attn_state = _prepare(layer.attention_conv, u, window.width)
            qkv = fused_linear(torch.cat([ctx, h], 1), [attn.q_proj, attn.k_proj, attn.v_proj])  # [1, C+W, (QH+2KVH)D]
            q = tk.block_rope_write(qkv, positions, self.inv_freq, attn.q_norm.weight, attn.k_norm.weight, c, kv[i, 0],
                                    kv[i, 1], attn.num_heads, attn.q_norm.eps)
            out = k.split_attention(q, kv[i, 0], kv[i, 1], window.block_pos[:1], h.shape[1], window.keys, causal=False,
                                    span=self.config.layer_span(i))
            x, u = k.add_rms(x, _finish(layer.attention_conv, attn.o_proj(out), attn_state), post.weight, post.eps)
            u, mlp_state = _prepare(layer.mlp_conv, u, window.width)
            norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, u = k.add_rms(x, _finish(layer.mlp_conv, layer.mlp(u, k), mlp_state), norm.weight, norm.eps)
        return u

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] or [B, T]; returns cos, sin: [T, 1, D] or [B, T, 1, D]
        cos, sin = rope_tables(self.inv_freq, positions.reshape(-1), dtype)
        return cos.view(*positions.shape, 1, cos.shape[-1]), sin.view(*positions.shape, 1, sin.shape[-1])

    def embed_block(self, tokens: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """The block input: the target's embedding of `[anchor, MASK...]` rows, times z-lab's optional scale."""
        # tokens: [B, W'] int64; embed: [V, H]; returns [B, W', H]
        x = F.embedding(tokens, embed)
        scale = self.config.input_embedding_scale
        return x * scale if scale != 1.0 else x

    def cache_window(self, context_pos: torch.Tensor, block_pos: torch.Tensor, keys: int,
                     dtype: torch.dtype, exact: bool = False) -> Window:
        """Metadata of an inference forward: context and one block in the cache, the first `keys` cells attended.

        A block row sees every cell up to the block's last row (the context and the block),
        causally and/or within the sliding window per layer; later cells (stale or unused)
        are masked. Built from device tensors only, so a CUDA graph can capture it. `exact`
        (eager): the keys end at the block's last row, so a full, non-causal layer needs no
        mask at all and SDPA may pick its mask-free kernels.
        """
        # context_pos: [C]; block_pos: [W] (consecutive); returns masks of [G*W, keys] additive `dtype`
        cfg = self.config
        if block_pos.shape[0] == 0:
            return Window(context_pos, block_pos, [], keys, 0)
        if self.kernels.split_attention is not None:  # `_forward_triton`'s attention needs no mask
            return Window(context_pos, block_pos, [None] * cfg.num_layers, keys, block_pos.shape[0])
        key = torch.arange(keys, device=block_pos.device)[None, :]  # [1, S]
        query = block_pos[:, None]  # [W, 1]
        written = (key <= block_pos[-1:, None]).expand(block_pos.shape[0], keys)  # [W, S]
        masks = layer_masks(cfg, written, key, query, dtype, no_full_mask=exact)
        return Window(context_pos, block_pos, masks, keys, block_pos.shape[0])

    def slots_window(self, context_pos: torch.Tensor, block_pos: torch.Tensor, last: torch.Tensor, keys: int,
                     dtype: torch.dtype) -> Window:
        """Metadata of a forward over B cache slots at once, each row at its own positions.

        Block row w of slot b sees the cells up to ``last[b]`` (its own block's last drafted
        row: a row drafting k < W-1 tokens is attended exactly as a (k+1)-row block), causally
        and/or within the sliding window per layer. Device tensors only (CUDA-graph safe).
        """
        # context_pos: [B, C]; block_pos: [B, W] (consecutive per row); last: [B]; masks: [B, 1, G*W, keys]
        cfg = self.config
        if block_pos.shape[1] == 0:
            return Window(context_pos, block_pos, [], keys, 0)
        key = torch.arange(keys, device=block_pos.device)[None, None, :]  # [1, 1, S]
        query = block_pos[:, :, None]  # [B, W, 1]
        written = (key <= last[:, None, None]).expand(*block_pos.shape, keys)  # [B, W, S]
        masks = layer_masks(cfg, written, key, query, dtype)
        return Window(context_pos, block_pos, [m[:, None] for m in masks], keys, block_pos.shape[1])

    def draft_slots(self, features: torch.Tensor, block: torch.Tensor | None, start: torch.Tensor,
                    num_new: torch.Tensor, last: torch.Tensor, kv: torch.Tensor, keys: int) -> torch.Tensor | None:
        """One forward over B slots: slot b ingests ``num_new[b]`` context rows at ``start[b]`` and drafts its block
        right after them (at ``start[b] + num_new[b]``), attending the first ``keys`` cells.

        ``features`` is padded to C rows: row j >= num_new[b] is stale and lands at a cell past
        the slot's new context, where the block (or the next cycle) overwrites it before any
        query reads it, so every row of every slot runs with static shapes. Committing the
        new lengths is the caller's business (per slot, on the host).
        """
        # features: [B, C, n_taps*H]; block: [B, W, H] or None; start, num_new, last: [B] int64
        # kv: [L, 2, B, capacity, KVH, D] (the B slots' rows); returns [B, W, H] or None
        device = features.device
        context_pos = start[:, None] + torch.arange(features.shape[1], device=device)  # [B, C]
        width = 0 if block is None else block.shape[1]
        block_pos = (start + num_new)[:, None] + torch.arange(width, device=device)  # [B, W]
        window = self.slots_window(context_pos, block_pos, last, keys, features.dtype)
        return self(features, block, window, kv)

    def draft(self, features: torch.Tensor, start: int, block: torch.Tensor | None, cache: KVCache
              ) -> torch.Tensor | None:
        """Eager: ingest `features` at positions [start, start+C), run `block` right after them, commit the context.

        The block's K/V sit past the committed length, so the cache still describes only
        the context afterwards (the next call's `crop` or writes replace them).
        """
        # features: [1, C, n_taps*H]; block: [1, W, H] or None; returns [1, W, H] or None
        c, w = features.shape[1], 0 if block is None else block.shape[1]
        end = start + c + w
        cache.ensure(end)
        device = features.device
        window = self.cache_window(torch.arange(start, start + c, device=device),
                                   torch.arange(start + c, end, device=device), end, features.dtype, exact=True)
        hidden = self(features, block, window, cache.buffer)
        cache.commit(start + c)
        return hidden


def layer_masks(cfg: DFlashConfig, written: torch.Tensor, key: torch.Tensor, query: torch.Tensor,
                dtype: torch.dtype | None, no_full_mask: bool = False) -> list[torch.Tensor | None]:
    """One folded additive mask per layer, shared by the layers of a kind (causal or not, sliding or full).

    A block row sees the cells in `written` (its context and block), causally and/or within the
    sliding window as its layer says. `no_full_mask`: a full, non-causal layer gets None (the
    keys end exactly at the block, so SDPA may use its mask-free kernels).
    """
    # written: [..., W, S] bool; key: [..., 1, S]; query: [..., W, 1]; masks: [..., G*W, S]
    by_kind: dict = {}
    masks = []
    for i in range(cfg.num_layers):
        causal = cfg.layer_is_causal(i)
        span = cfg.layer_span(i)
        if (causal, span) not in by_kind:
            if no_full_mask and not causal and span is None:
                by_kind[causal, span] = None
            else:
                visible = written & (key <= query) if causal else written
                if span is not None:
                    visible = visible & (query - key < span)
                    if not causal:
                        visible = visible & (key - query < span)
                by_kind[causal, span] = fold_mask(visible, cfg.num_heads // cfg.num_kv_heads, dtype)
        masks.append(by_kind[causal, span])
    return masks


def fold_mask(visible: torch.Tensor, groups: int, dtype: torch.dtype | None) -> torch.Tensor:
    """A [..., W, S] visibility in attend_prefix's row order (G query heads per KV head): [..., G*W, S].

    `dtype` None keeps it boolean (training: autocast-safe); else an additive mask in `dtype`.
    """
    if dtype is not None:
        visible = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
    return torch.cat([visible] * groups, dim=-2) if groups > 1 else visible


def _joined(context_pos: torch.Tensor, block_pos: torch.Tensor) -> torch.Tensor:
    """Context positions, then block positions, per row when either is (training: shared context, per-row blocks)."""
    # context_pos: [C] or [B, C]; block_pos: [W'] or [B, W']; returns [C+W'] or [B, C+W']
    if context_pos.dim() < block_pos.dim():
        context_pos = context_pos.expand(block_pos.shape[0], -1)
    elif block_pos.dim() < context_pos.dim():
        block_pos = block_pos.expand(context_pos.shape[0], -1)
    return torch.cat([context_pos, block_pos], -1)


def _flat_cells(positions: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Per-row cache positions as indices into one layer's cells flattened over (slot, position)."""
    # positions: [B, T]; kv: [L, 2, B, capacity, KVH, D]; returns [B*T]
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None] * kv.shape[3]
    return (rows + positions).reshape(-1)


def _store(cells: torch.Tensor, positions: torch.Tensor, flat: torch.Tensor | None, values: torch.Tensor) -> None:
    """Write K or V rows into one layer's cache: at shared positions ([T]) or per-row ones (``flat``)."""
    # cells: [B, capacity, KVH, D]; positions: [T] or [B, T]; values: [B, T, KVH, D]
    if flat is None:
        cells.index_copy_(1, positions, values)
    else:
        cells.view(-1, *cells.shape[2:]).index_copy_(0, flat, values.reshape(-1, *values.shape[2:]))


def _prepare(conv, u: torch.Tensor, width: int):
    """A sublayer wrapper's `prepare` on every block separately (no state crosses blocks); identity without one."""
    # u: [B, N*W, H]; returns [B, N*W, H] and the wrapper's state (None without a wrapper)
    if conv is None:
        return u, None
    out, state = conv.prepare(u.reshape(-1, width, u.shape[-1]))
    return out.reshape_as(u), state


def _finish(conv, y: torch.Tensor, state) -> torch.Tensor:
    # y: [B, N*W, H]; state from `_prepare`, per block; returns [B, N*W, H]
    if conv is None:
        return y
    return conv.finish(y.reshape(state.shape[0], state.shape[1], y.shape[-1]), state).reshape_as(y)


def draft_logits(hidden: torch.Tensor, head_weight: torch.Tensor, cfg: DFlashConfig) -> torch.Tensor:
    """Target LM head on the draft rows, then z-lab's optional multiplier and softcap (float32)."""
    # hidden: [B, K, H]; head_weight: [V, H]; returns [B, K, V]
    # As one [B*K, H] matmul: a strided 3-D input (the block's rows 1..K of several slots) would go to a
    # batched matmul over the head expanded per slot, reading the whole head once per slot.
    logits = cpu_linear.linear(hidden.reshape(-1, hidden.shape[-1]), head_weight).view(*hidden.shape[:-1], -1).float()
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping:
        c = cfg.final_logit_softcapping
        logits = torch.tanh(logits / c) * c
    return logits
