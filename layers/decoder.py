"""The decoder layer of Qwen3 / Llama / Qwen2 / Qwen3-Next: attention (or Gated DeltaNet), MLP (or MoE), norms.

Module and parameter names equal the HF names, so loading is a rename, not a rewrite.
Attention reads and writes an external `KVCache` at absolute positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.layers.config import TargetConfig
from draftflow.layers.gdn import GatedDeltaNet
from draftflow.layers.kv_cache import KVCache
from draftflow.layers.moe import SparseMoeBlock
from draftflow.layers.norm import RMSNorm
from draftflow.layers.rope import rotate

# `enable_gqa` lets SDPA broadcast KV heads without materialising repeated K/V (torch >= 2.5).
_NATIVE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


class Attention(nn.Module):
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
        self.qk_norm = cfg.qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        cache: KVCache,
        layer: int,
        start_pos: int,
        mask: torch.Tensor | None,  # [T, start_pos+T] bool, or None when is_causal / T == 1 suffices
    ) -> torch.Tensor:
        # returns: [B, T, H]
        b, t, _ = x.shape
        gate = None
        if self.gated:
            q, gate = self.q_proj(x).view(b, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        cache.write(layer, start_pos, k, v)
        keys, values = cache.read(layer, start_pos + t)  # [B, S, KVH, D]
        q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        # is_causal aligns the mask top-left, which is right only when the window starts at 0.
        causal = mask is None and t > 1
        if _NATIVE_GQA:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=causal,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
        else:  # pragma: no cover - old torch only
            rep = self.num_heads // self.num_kv_heads
            keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal)
        out = out.transpose(1, 2).reshape(b, t, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(b, t, -1))
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: TargetConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(h, i, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
