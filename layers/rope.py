"""Rotary position embeddings: the one inverse-frequency table builder (every scaling) and the rotation.

`rope_inv_freq` turns a config's theta, rotary dim and scaling (none, llama3, per-frequency
factors) into the table; `rope_tables` turns positions into cos/sin; `rotate` applies them
in the half-split layout of HF `rotate_half`. Every model (target, MTP, DFlash) uses these.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from draftflow.layers.config import TargetConfig


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


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for `positions` ([T] int64, on the device): each [T, 1, 2 * len(inv_freq)] in `dtype`."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, heads, D]; cos, sin: [T, 1, R] (half-split layout, as HF `rotate_half`); R < D: partial rotary
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat((rotate(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
