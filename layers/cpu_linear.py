"""`F.linear` for float32 CPU tensors, sent to oneDNN where MKL is slow: one product, one fixed rule.

torch's CPU `F.linear` runs MKL's sgemm. On AMD EPYC CPUs MKL is slow at the shapes a
decode step and a verify window have: a one-row `[1, 384] x [384, 8192]` LM head took 791
µs against oneDNN's 156, a 16-row window 1.4-3x longer; small one-row products are the
other way round, a oneDNN call costing ~25 µs more (`benchmarks/cpu_linear_backends.py`,
docs/BENCHMARKS.md). So a float32 CPU product goes to oneDNN
(`torch.ops.mkldnn._linear_pointwise`) when it has more than one row or its weight has at
least `ONEDNN_WEIGHTS` elements, and to `F.linear` otherwise.

The rule is fixed, not timed: a timed choice could differ between two runs and round one
prompt two ways. Other devices and dtypes go to `F.linear` unchanged. Without oneDNN in the
torch build everything goes to `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ONEDNN_WEIGHTS = 512 * 1024  # one-row products with at least this many weights go to oneDNN
HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` takes oneDNN: float32 on the CPU, and a window or a large weight."""
    if not HAS_ONEDNN or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 \
            or not weight.is_contiguous() or x.numel() == 0:
        return False
    return x.numel() > x.shape[-1] or weight.numel() >= ONEDNN_WEIGHTS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [..., K], weight [N, K]; returns [..., N]."""
    if not uses_onednn(x, weight) or x.requires_grad or weight.requires_grad:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "").view(*x.shape[:-1], weight.shape[0])
