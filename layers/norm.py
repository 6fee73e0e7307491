"""RMSNorm as Qwen3, Llama and Qwen3-Next compute it (float32 statistics, the HF rounding order).

On CUDA, outside autograd, float32 and bfloat16 rows go through the Triton kernel of
`triton_kernels.add_rms` (the one the target's decode graphs use): one launch, or one graph
node, instead of five. That is where the modules themselves run on the GPU: the DFlash,
DFlash2 and MTP drafters' forwards (captured in their graphs) and eager prefills. On the
H200 the DFlash drafter's graph held about a hundred small kernels a draft, ten norms of
five kernels each among them (benchmarks/demo_cycle_profile.py). On the CPU, float32 rows
(without the Qwen3-Next offset) go through torch's own `F.rms_norm`, which rounds as the
plain ops do, bit for bit (`fused.cpu_rows`). Training on CUDA (autograd), other CPU dtypes
and float16 keep the plain ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.layers.fused import cpu_rows


_ROWS_DTYPES = (torch.float32, torch.bfloat16)  # what the Triton kernel takes


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
        if x.is_cuda and x.dtype in _ROWS_DTYPES and x.dtype == self.weight.dtype and x.is_contiguous() \
                and x.numel() and not torch.is_grad_enabled():  # an empty tensor has no pointer to give Triton
            from draftflow.layers.triton_kernels import add_rms

            return add_rms(x, None, self.weight, self.eps, self.offset)[1]
        if cpu_rows(x, self.weight, self.offset):
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)
