"""RMSNorm as Qwen3, Llama and Qwen3-Next compute it (float32 statistics, the HF rounding order)."""

from __future__ import annotations

import torch
from torch import nn


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
