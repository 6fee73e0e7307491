"""The DFlash block drafter: Qwen3 layers whose keys/values see projected target features.

One forward drafts a whole block: the input is the target's embedding of
`[anchor, MASK x (W-1)]` and every block row attends to the cached *context* (keys and
values projected from the committed tokens' feature taps) plus the block itself —
non-causally in full-attention layers, as the drafter was trained. Context K/V are
computed once per committed token (`add_context`) and kept in a position-addressed
`KVCache`; the block's own K/V are written past the committed length and dropped by
the next `crop`, so nothing is ever copied or reallocated.

Module names equal the z-lab checkpoint names, so loading is `load_state_dict`.
The embedding and LM head are not part of the drafter: callers pass the target's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.plugins.dflash.config import DFlashConfig
from draftflow.layers.kv_cache import KVCache
from draftflow.layers.decoder import MLP
from draftflow.layers.norm import RMSNorm
from draftflow.layers.rope import rope_inv_freq
from draftflow.layers.rope import rotate as _rotate

# `enable_gqa` lets SDPA broadcast KV heads without materialising repeated K/V (torch >= 2.5).
_NATIVE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        kw = {"dtype": dtype, "device": device, "bias": False}
        self.q_proj = nn.Linear(h, cfg.num_heads * d, **kw)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, **kw)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, **kw)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, **kw)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated, normed keys and values of `x` (context or block rows)."""
        # x: [1, T, H]; cos, sin: [T, 1, D]; returns k, v: [1, T, KVH, D]
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        return _rotate(k, cos, sin), v


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = DFlashAttention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)
        # Optional sublayer wrappers (DFlash2's dynamic convolutions): an object with
        # `prepare(u) -> (u', state)` applied to the normed sublayer input and
        # `finish(y, state) -> y'` applied to the sublayer output before the residual add.
        self.attention_conv = None
        self.mlp_conv = None

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor, attn_state) -> torch.Tensor:
        """The rest of the layer after attention: side-1 conv, residual, MLP sublayer (with its convs)."""
        # x, attn_out: [1, W, H] (attn_out after o_proj); attn_state: the attention conv's kernel or None
        if self.attention_conv is not None:
            attn_out = self.attention_conv.finish(attn_out, attn_state)
        x = x + attn_out
        u = self.post_attention_layernorm(x)
        if self.mlp_conv is None:
            return x + self.mlp(u)
        u, mlp_state = self.mlp_conv.prepare(u)
        return x + self.mlp_conv.finish(self.mlp(u), mlp_state)


class DFlashModel(nn.Module):
    """Drafter weights plus the two forwards: `add_context` and `forward` (one block)."""

    def __init__(self, cfg: DFlashConfig, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_taps * h, h, bias=False, dtype=dtype, device=device)
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

    def _rope(self, start: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # returns cos, sin: [T, 1, D] for absolute positions start .. start+T-1
        pos = torch.arange(start, start + length, device=self.inv_freq.device)
        freqs = pos.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def add_context(self, features: torch.Tensor, start: int, cache: KVCache) -> None:
        """Project committed feature taps at positions [start, start+C) into every layer's K/V."""
        # features: [1, C, n_taps * H]
        ctx = self.hidden_norm(self.fc(features))  # [1, C, H]; shared by all layers, never input-normed
        cos, sin = self._rope(start, ctx.shape[1], ctx.dtype)
        cache.ensure(start + ctx.shape[1])
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(ctx, cos, sin)
            cache.write(i, start, k, v)
        cache.commit(start + ctx.shape[1])

    def forward(self, block: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run one block whose row 0 (the anchor) sits at position `cache.length`; return normed hidden states.

        The block's K/V are written at [length, length+W) but not committed, so the cache
        still describes only the context afterwards.
        """
        # block: [1, W, H] (target embeddings of [anchor, MASK...], scaled); returns [1, W, H]
        cfg = self.config
        start, width = cache.length, block.shape[1]
        end = start + width
        cache.ensure(end)
        cos, sin = self._rope(start, width, block.dtype)
        x = block
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h, attn_state = layer.input_layernorm(x), None
            if layer.attention_conv is not None:
                h, attn_state = layer.attention_conv.prepare(h)
            q = attn.q_norm(attn.q_proj(h).view(1, width, attn.num_heads, attn.head_dim))
            q = _rotate(q, cos, sin)
            k, v = attn.keys_values(h, cos, sin)
            cache.write(i, start, k, v)
            keys, values = cache.read(i, end)  # [1, end, KVH, D]: context then block
            mask = _mask(start, width, cfg.layer_is_causal(i),
                         cfg.sliding_window if cfg.layer_type(i) == "sliding_attention" else None, block.device)
            out = _attend(q, keys, values, mask, attn.num_heads != attn.num_kv_heads)
            x = layer.finish(x, attn.o_proj(out.reshape(1, width, -1)), attn_state)
        return self.norm(x)


def _mask(start: int, width: int, causal: bool, window: int | None, device) -> torch.Tensor | None:
    """Visibility [W, start+W] for block rows; None = every row sees every key (full, non-causal)."""
    if not causal and window is None:
        return None
    query = torch.arange(start, start + width, device=device)[:, None]  # [W, 1]
    key = torch.arange(start + width, device=device)[None, :]  # [1, S]
    visible = torch.ones(width, start + width, dtype=torch.bool, device=device)
    if causal:
        visible &= key <= query
    if window is not None:
        visible &= query - key < window
        if not causal:
            visible &= key - query < window
    return visible


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, gqa: bool) -> torch.Tensor:
    # q: [1, W, NH, D]; keys, values: [1, S, KVH, D]; returns [1, W, NH, D]
    q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    if _NATIVE_GQA:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
    else:  # pragma: no cover - old torch only
        rep = q.shape[1] // keys.shape[1]
        out = F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1), attn_mask=mask)
    return out.transpose(1, 2)


def draft_logits(hidden: torch.Tensor, head_weight: torch.Tensor, cfg: DFlashConfig) -> torch.Tensor:
    """Target LM head on the draft rows, then z-lab's optional multiplier and softcap (float32)."""
    # hidden: [1, K, H]; head_weight: [V, H]; returns [1, K, V]
    logits = F.linear(hidden, head_weight).float()
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping:
        c = cfg.final_logit_softcapping
        logits = torch.tanh(logits / c) * c
    return logits
