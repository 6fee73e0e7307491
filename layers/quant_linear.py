"""A linear layer whose weight stays in its GGUF block layout on the device (issue 20, item 2).

`QuantLinear` holds the file's bytes as one uint8 tensor `blocks` [out_features, row bytes]
(GGUF rows are whole blocks, stored row after row, so a row slice or a row concatenation of
the bytes is the same slice or concatenation of the weight) and runs its product with the
Triton kernels of `quant_kernels`, which dequantize inside the matrix product. The loader
(plugins/target/gguf_loader.py) puts one in place of the `nn.Linear` of each attention and
dense-MLP projection whose type `QTYPES` covers, on CUDA; everything else (the embedding, the
LM head, MoE experts, norms, uncovered types) is dequantized at load as before.

`repack()` rewrites the bytes once into quant_repack's layout (16-byte aligned codes, scales
as the file's own fields; exact) and frees them: products then run quant_gemv_repacked's
kernels. The loader repacks when `REPACK` (or its `repacked` argument) says so.

Nothing here imports Triton: the kernels are imported on the first product, so a CPU-only
install (which never builds a QuantLinear) does not need Triton.
"""

from __future__ import annotations

import re

import torch
from torch import nn

# GGUF types the kernels read, with (weights per block, bytes per block) of the published layouts
# (gguf-py's quants.py, llama.cpp's ggml-common.h).
LAYOUT = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
QTYPES = tuple(LAYOUT)
REPACK = True  # the loader's default: repack kept projections at load (quant_repack). H200, 2026-12-01: Q4_K_M
# decode 1.86x faster than the file's blocks (5.8 vs 10.8 ms a token; benchmarks/gpu_quant.py --quick, docs/GGUF.md)
# The projections a QuantLinear replaces, by GGUF name: attention q/k/v/o and a dense MLP's gate/up/down
# (not MoE experts `ffn_*_exps`, shared experts `ffn_*_shexp`, the embedding or the LM head).
PROJECTION = re.compile(r"^blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight$")


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one weight row of `in_features` weights (a whole number of blocks)."""
    block, size = LAYOUT[qtype]
    if in_features % block:
        raise ValueError(f"{qtype} rows are whole blocks of {block} weights; got rows of {in_features}")
    return in_features // block * size


def keeps_quantized(device: torch.device | str, wanted: bool, tp_size: int = 1) -> bool:
    """Whether a GGUF target loaded on `device` keeps its covered projections quantized: on CUDA, one rank, unless
    the node's `quantized: false` asks for dequantization at load."""
    return bool(wanted) and torch.device(device).type == "cuda" and tp_size == 1


def kept(gguf_name: str, type_name: str) -> bool:
    """Whether GGUF tensor `gguf_name` of type `type_name` stays quantized (when the target keeps any)."""
    return type_name in LAYOUT and PROJECTION.match(gguf_name) is not None


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W in GGUF blocks: `blocks` [out_features, row_bytes] uint8, `bias` [out_features] or None.

    The product reads each weight byte once for all rows of a decode or verify window (a GEMV
    kernel up to `quant_kernels.GEMV_MAX_ROWS` rows) and otherwise dequantizes into a scratch
    tensor for torch.matmul (prefill). No host sync and no shape-dependent host state, so it
    runs inside CUDA graphs.
    """

    def __init__(self, qtype: str, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.qtype, self.in_features, self.out_features = qtype, in_features, out_features
        self.register_buffer("blocks", torch.empty(out_features, row_bytes(qtype, in_features), dtype=torch.uint8,
                                                   device=device))
        self.register_buffer("packed", None)  # [out_features, quant_repack.row_bytes] uint8 after `repack()`
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def replacing(cls, linear: nn.Linear, qtype: str) -> QuantLinear:
        """An empty QuantLinear of `linear`'s shape, bias, dtype and device (meta while loading)."""
        return cls(qtype, linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype,
                   linear.weight.device)

    @property
    def data(self) -> torch.Tensor:
        """The bytes products read: `packed` once repacked, else the file's `blocks`."""
        return self.blocks if self.packed is None else self.packed

    def repack(self) -> None:
        """Rewrite the file's bytes into the repacked layout (on their device) and free them. Idempotent."""
        if self.packed is None:
            from draftflow.layers.quant_repack import repack

            self.packed, self.blocks = repack(self.blocks, self.qtype, self.in_features), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features] in x.dtype
        return self.product(x, self.data, self.bias)

    def product(self, x: torch.Tensor, data: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """x times the weight of `data` (this layer's type, layout and row width; more rows after fusion)."""
        if self.packed is not None:
            from draftflow.layers.quant_gemv_repacked import repacked_matmul

            return repacked_matmul(x, data, self.qtype, self.in_features, bias, out)
        from draftflow.layers.quant_kernels import quant_matmul

        return quant_matmul(x, data, self.qtype, self.in_features, bias, out)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out_features, in_features] in `dtype` (tests, debugging)."""
        if self.packed is not None:
            from draftflow.layers.quant_repack import unpack

            return unpack(self.packed, self.qtype, self.in_features).to(dtype)
        from draftflow.layers.quant_kernels import dequantize

        return dequantize(self.blocks, self.qtype, self.in_features, dtype)

    def extra_repr(self) -> str:
        return (f"{self.qtype}{', repacked' if self.packed is not None else ''}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")


def repack_all(model: nn.Module) -> int:
    """Repack every QuantLinear of `model` (before `fuse_projections`, or after: it joins the repacked rows then);
    returns how many."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for layer in layers:
        layer.repack()
    return len(layers)


def swap_in(model: nn.Module, path: str, qtype: str) -> QuantLinear:
    """Replace the nn.Linear at `path` (e.g. `layers.3.self_attn.q_proj`) by an empty QuantLinear; return it."""
    parent, _, child = path.rpartition(".")
    owner = model.get_submodule(parent)
    layer = QuantLinear.replacing(getattr(owner, child), qtype)
    setattr(owner, child, layer)
    return layer
