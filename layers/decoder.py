"""The decoder layer of Qwen3 / Llama / Qwen2 / Qwen3-Next: attention (or Gated DeltaNet), MLP (or MoE), norms.

Module and parameter names equal the HF names, so loading is a rename, not a rewrite.
Attention reads and writes an external `KVCache` at absolute positions given by an
`attention.Window`; the small pieces run with the `fused.Kernels` the caller chose.
"""

from __future__ import annotations

import torch
from torch import nn

from draftflow.layers.config import TargetConfig
from draftflow.layers.gdn import GatedDeltaNet
from draftflow.layers.attention import Window, attend, fold
from draftflow.layers.fused import PLAIN, Kernels, fused_linear
from draftflow.layers.moe import SparseMoeBlock
from draftflow.layers.norm import RMSNorm


class Attention(nn.Module):
    """Grouped-query attention with the options of every supported model: q/k/v and o biases, per-head q/k
    RMSNorm (with the Qwen3-Next (1 + w) offset), partial rotary, a sigmoid output gate (q_proj emits
    [query | gate] per head). One forward for eager and captured windows (see attention.Window)."""

    def __init__(self, cfg: TargetConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        kw = {"dtype": dtype, "device": device}
        self.gated = cfg.attn_output_gate  # q_proj emits [query | gate] per head
        self.q_proj = nn.Linear(h, cfg.num_heads * d * (2 if self.gated else 1), bias=cfg.attention_bias, **kw)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias, **kw)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias, **kw)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias, **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device, cfg.norm_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device, cfg.norm_offset)
        self.qk_norm, self.offset, self.eps = cfg.qk_norm, cfg.norm_offset, cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        # The Triton prologue rotates whole heads and scales by w: plain heads, full rotary, no offset.
        self.prologue_ok = not self.gated and cfg.rotary_dim == d and not cfg.norm_offset and d & (d - 1) == 0

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [T, 1, R], or [B, T, 1, R] for per-row positions
        sin: torch.Tensor,  # [T, 1, R], or [B, T, 1, R]
        cache,  # KVCache (or a duck-typed training cache with write/read)
        layer: int,
        start_pos: int | None = None,
        mask: torch.Tensor | None = None,  # eager callers: None when causal from 0 / one token; else any mask
        *,
        window: Window | None = None,
        kernels: Kernels = PLAIN,
    ) -> torch.Tensor:
        """Write this window's K/V into `cache` layer `layer` and attend; returns [B, T, H].

        Either `window` (device-side metadata) or a host `start_pos` (then the exact prefix
        [0, start_pos + T) is read; `mask` None means causal from 0 or a single token).
        """
        b, t, _ = x.shape
        if window is None:
            window = Window.at(start_pos, t, x.device, causal=mask is None)
        d, qh, kvh = self.head_dim, self.num_heads, self.num_kv_heads
        q_rows = qh * d * (2 if self.gated else 1)
        norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        qkv = fused_linear(x, [self.q_proj, self.k_proj, self.v_proj], kernels.matmul)  # None unless fused (fuse_projections)
        gate = None
        if qkv is not None and kernels.prologue is not None and self.prologue_ok and hasattr(cache, "buffer"):
            kv = cache.buffer
            q = kernels.prologue(qkv, cos.squeeze(-2), sin.squeeze(-2), *norms, window.start, kv[layer, 0], kv[layer, 1],
                                 qh, self.eps)  # [B, KVH, G*T, D], K/V written
        else:
            if qkv is not None:
                q, k, v = qkv.split([q_rows, kvh * d, kvh * d], dim=-1)
            else:
                q, k, v = (kernels.project(lin, x) for lin in (self.q_proj, self.k_proj, self.v_proj))
            if self.gated:
                q, gate = q.view(b, t, qh, 2 * d).chunk(2, dim=-1)  # [B, T, QH, D] each
            else:
                q = q.unflatten(-1, (qh, d))  # [B, T, QH, D]
            k, v = k.unflatten(-1, (kvh, d)), v.unflatten(-1, (kvh, d))  # [B, T, KVH, D]
            q, k = kernels.qk_rope(q, k, *norms, cos, sin, self.eps, self.offset)
            window.write(cache, layer, k, v)
            q = fold(q, kvh)  # [B, KVH, G*T, D]
        if kernels.split_attention is not None and hasattr(cache, "buffer"):
            kv = cache.buffer
            out = kernels.split_attention(q, kv[layer, 0], kv[layer, 1], window.start, t, window.keys)
        else:
            keys, values = cache.read(layer, window.keys)  # [B, S, KVH, D]
            out = attend(q, keys, values, window)  # [B, T, QH*D]
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(b, t, -1))
        return kernels.project(self.o_proj, out)


class MLP(nn.Module):
    def __init__(self, cfg: TargetConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(h, i, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, kernels: Kernels = PLAIN) -> torch.Tensor:
        # x: [B, T, H] -> [B, T, H]
        gate_up = fused_linear(x, [self.gate_proj, self.up_proj], kernels.matmul)  # one product after fuse_projections
        if gate_up is not None:
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = kernels.project(self.gate_proj, x), kernels.project(self.up_proj, x)
        return kernels.project(self.down_proj, kernels.silu_mul(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, dtype: torch.dtype, device: torch.device | str | None, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.norm_offset)
        self.is_linear = cfg.is_linear(layer)
        # This layer's index among layers of its kind: its KV-cache layer or its LinearState layer.
        self.slot = sum(cfg.is_linear(i) == self.is_linear for i in range(layer))
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, dtype, device)
        else:
            self.self_attn = Attention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.norm_offset)
        self.mlp = SparseMoeBlock(cfg, dtype, device) if cfg.is_moe(layer) else MLP(cfg, dtype, device)
