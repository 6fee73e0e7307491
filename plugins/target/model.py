"""The target model: a qwen3 / llama / qwen2 decoder (or a qwen3_next hybrid) with one forward for every phase.

The same `forward` serves chunked prefill, one-token decode and multi-token verify
windows: tokens are always written to the cache at absolute positions
`start_pos .. start_pos+T-1` and attend to cache[:start_pos] plus the causal window.
Module and parameter names equal the HF names without the `model.` prefix, so loading
is a rename, not a rewrite. Hybrid stacks put a Gated DeltaNet (`linear_attn`, gdn.py)
in place of attention on some layers; those layers read and write a `LinearState`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.plugins.target.config import TargetConfig
from draftflow.plugins.target.gdn import GatedDeltaNet
from draftflow.plugins.target.kv_cache import KVCache
from draftflow.plugins.target.linear_state import LinearState
from draftflow.plugins.target.moe import SparseMoeBlock

# `enable_gqa` lets SDPA broadcast KV heads without materialising repeated K/V (torch >= 2.5).
_NATIVE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def rope_inv_freq(cfg: TargetConfig) -> torch.Tensor:
    """RoPE inverse frequencies, float32 on CPU, computed exactly as transformers does."""
    # returns: [rotary_dim // 2]
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs.rope_type == "freq_factors":  # llama.cpp form: theta_i / factor_i
        return inv / torch.tensor(rs.freq_factors, dtype=torch.float32)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def llama3_freq_factors(cfg: TargetConfig) -> torch.Tensor:
    """Per-frequency divisors equivalent to llama3 scaling, as llama.cpp's `rope_freqs.weight`."""
    # returns: [head_dim // 2]
    plain = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    return plain / rope_inv_freq(cfg)


class RMSNorm(nn.Module):
    """RMSNorm in float32, cast back before the weight multiply (the HF order).

    `offset` (Qwen3-Next): scale by (1 + w) in float32 and cast after, as transformers does.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str | None,
                 offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, heads, D]; cos, sin: [T, 1, R] (half-split layout, as HF `rotate_half`); R < D: partial rotary
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat((_rotate(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


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
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
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


class TargetModel(nn.Module):
    """Decoder-only target model over an external `KVCache`.

    Build on `device="meta"` and load with `load_state_dict(..., assign=True)` to avoid
    allocating weights twice; the loaders do that.
    """

    def __init__(
        self, cfg: TargetConfig, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.norm_offset)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        # Computed on CPU even for meta models; `.to(device)` after loading moves it.
        # On a real device the RoPE table goes there now; on meta it stays on the CPU until `.to(device)`.
        inv_freq = rope_inv_freq(cfg)
        if device is not None and torch.device(device).type != "meta":
            inv_freq = inv_freq.to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.requires_grad_(False)
        self.host_experts = None  # MoE: routed experts on the host (moe.HostExperts), set by the loaders
        self.expert_cache = None  # MoE: the device slots serving them (expert_cache.ExpertCache)

    def set_expert_cache(self, resident: int | None, grouped: bool | None = None):
        """MoE only: (re)build the expert cache with `resident` device slots (None = every expert).

        `grouped`: one grouped GEMM per layer and window, or one GEMM per routed expert (None: the
        measured default, see `ExpertCache`).
        """
        from draftflow.plugins.target.expert_cache import ExpertCache

        blocks = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]
        for block in blocks:  # free the old slots before allocating new ones (the blocks hold the old cache too)
            block.experts = None
        if self.expert_cache is not None:
            self.expert_cache.release()
        self.expert_cache = None
        if self.inv_freq.is_cuda:
            torch.cuda.empty_cache()
        self.expert_cache = ExpertCache(self.host_experts, resident, self.config.num_experts_per_tok, self.inv_freq.device,
                                        grouped)
        self.expert_cache.attach(blocks)
        return self.expert_cache

    def head_weight(self) -> torch.Tensor:
        """The LM-head matrix: [V, H] (the embedding itself when tied)."""
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64
        start_pos: int,
        cache: KVCache,
        logit_rows: int | torch.Tensor | None = None,  # None | count of last rows | [R] or [B, R] indices
        tap_layers: tuple[int, ...] | None = None,
        linear: LinearState | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run a window; return (logits [B, R, V] float32, taps [B, T, len(taps)*H] or None).

        Tap L is the hidden state after decoder layer L, i.e. transformers'
        `hidden_states[L+1]`; like transformers, the last layer's tap is taken after the
        final norm. The cache's committed length is not changed: the caller commits.
        Hybrid models also need `linear` (the Gated DeltaNet states); the window must start
        at its committed length, and the caller commits it too (`linear.commit`).
        """
        b, t = tokens.shape
        if start_pos > cache.length:
            raise ValueError(
                f"forward at start_pos={start_pos} but the KV cache holds only {cache.length} committed "
                "positions; commit the previous window first so attention never reads unwritten cells"
            )
        taps = tuple(tap_layers or ())
        bad = [i for i in taps if not 0 <= i < self.config.num_layers]
        if bad:
            raise ValueError(f"tap_layers {bad} are outside [0, {self.config.num_layers}); pick existing layers")
        cache.ensure(start_pos + t)
        recorded = False
        if self.config.is_hybrid:
            if linear is None:
                raise ValueError("this hybrid (qwen3_next) model has linear-attention layers; pass linear=LinearState "
                                 "(LinearState.allocate(cfg, batch, max_window, dtype, device))")
            recorded = linear.begin(start_pos, t)

        pos = torch.arange(start_pos, start_pos + t, device=tokens.device)  # [T]
        freqs = pos.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        x = self.embed_tokens(tokens)  # [B, T, H]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        mask = None
        if start_pos > 0 and t > 1:
            keys = torch.arange(start_pos + t, device=tokens.device)  # [S]
            mask = keys[None, :] <= pos[:, None]  # [T, S]

        if self.host_experts is not None and self.expert_cache is None:
            self.set_expert_cache(None)  # nobody sized the cache: keep every expert resident
        captured: dict[int, torch.Tensor] = {}
        last = self.config.num_layers - 1
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            if layer.is_linear:
                x = x + layer.linear_attn(h, linear, layer.slot, recorded)
            else:
                x = x + layer.self_attn(h, cos, sin, cache, layer.slot, start_pos, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in taps and i != last:
                captured[i] = x
        if last in taps:
            captured[last] = self.norm(x)
        tapped = torch.cat([captured[i] for i in taps], dim=-1) if taps else None

        if logit_rows is None:
            rows = x
        elif isinstance(logit_rows, int):
            rows = x[:, t - logit_rows :]
        elif logit_rows.dim() == 1:
            rows = x.index_select(1, logit_rows)
        else:  # [B, R]: per-sequence rows
            rows = x.gather(1, logit_rows[:, :, None].expand(-1, -1, x.shape[-1]))
        logits = F.linear(self.norm(rows), self.head_weight()).float()  # [B, R, V]
        return logits, tapped
