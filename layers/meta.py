"""Modules built on the meta device (the loaders build there, then assign the checkpoint's tensors).

`nn.Embedding` draws its initial weights with `normal_`, which on the meta device runs torch's
Python reference implementation and imports `torch._dynamo` for it: ~1.2 s of every cold start
(`draftflow generate` took 3.1 s on the demo, 1.3 s of it that import). Built here, a meta
embedding gets an empty weight instead; on any other device (training) it is initialised as usual.
"""

from __future__ import annotations

import torch
from torch import nn


def embedding(num: int, dim: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Embedding:
    """`nn.Embedding(num, dim)` on `device`, with no initial draw when `device` is meta."""
    weight = None
    if device is not None and torch.device(device).type == "meta":
        weight = torch.empty(num, dim, dtype=dtype, device=device)
    return nn.Embedding(num, dim, dtype=dtype, device=device, _weight=weight)
