"""The small pieces of a decoder forward, plain or fused, and the fused weight layout.

At batch 1 a decode step's matrix products are memory-bound GEMVs and everything between
them is launch-bound. `Kernels` is the choice a forward runs those pieces with:

- ``Kernels()``: plain torch ops (eager prefill, CPU, training under autograd);
- ``Kernels(compiled=True)``: torch.compile turns residual add + RMSNorm, q/k-norm + RoPE
  and the SiLU gate into one kernel each;
- ``prologue=True`` / ``split_attention=True`` (CUDA): the Triton kernels of
  ``triton_kernels`` do q/k-norm + RoPE + the KV write in one launch and attention split
  over key blocks; ``elementwise=True`` (CUDA): residual add + RMSNorm and the SiLU gate
  as Triton kernels (no torch.compile, so nothing is traced at warm-up), and the one-row
  attention output projection as `gemv.linear` where that measured faster than cuBLAS.

Every variant rounds where the plain ops round, so float32 results agree to rounding.
`fuse_projections` lets q/k/v and gate/up run as one product each without copying weights
(`fused_linear`; GGUF weights kept quantized too: their block bytes concatenate by rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.layers import cpu_linear
from draftflow.layers.rope import rotate


# --- the elementwise pieces ------------------------------------------------------------------
def cpu_rows(x: torch.Tensor, weight: torch.Tensor, offset: bool) -> bool:
    """Whether torch's own RMSNorm may run these rows: float32 on the CPU, where it rounds exactly as the plain ops
    below (bit for bit: tests/layers/test_fused_cpu.py) in one op instead of five (~10-15 us less a call on a 2-core
    CPU, where a decode step and a draft block are dozens of norms)."""
    return x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and not offset


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """RMSNorm exactly as `norm.RMSNorm`: float32 statistics; (1 + w) in float32 with `offset` (Qwen3-Next)."""
    # x: [..., dim]; weight: [dim]
    if cpu_rows(x, weight, offset):
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def add_rms(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
            offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (x + delta, its RMSNorm)."""
    # x, delta: [B, T, H]
    x = x + delta
    return x, rms(x, weight, eps, offset)


def qk_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
            cos: torch.Tensor, sin: torch.Tensor, eps: float, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q/k RMSNorm (when weights are given), then RoPE (partial when cos is narrower than D)."""
    # q: [B, T, QH, D]; k: [B, T, KVH, D]; cos, sin: [T, 1, R]
    if q_weight is not None:
        q, k = rms(q, q_weight, eps, offset), rms(k, k_weight, eps, offset)
    return rotate(q, cos, sin), rotate(k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # gate, up: [B, T, I]
    return F.silu(gate) * up


def _compile(fn: Callable) -> Callable:
    options = {}
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "emulate_precision_casts"):
        options["emulate_precision_casts"] = True  # round where eager rounds, so bf16 results track the plain ops
    return torch.compile(fn, fullgraph=True, options=options)


class Kernels:
    """How a forward runs its small pieces: plain, compiled, with Triton kernels for the prologue, attention, elementwise.

    Chosen once (at model or runner construction), never per call. `compiled`: torch.compile
    each piece (once per function; the window length becomes dynamic on its second size).
    `elementwise` (CUDA): residual add + RMSNorm and the SiLU gate as Triton kernels, which
    load from Triton's disk cache in a fresh process instead of compiling; tensors they do not
    take (float16, odd strides) fall back to the plain or compiled piece.
    """

    def __init__(self, compiled: bool = False, prologue: bool = False, split_attention: bool = False,
                 elementwise: bool = False) -> None:
        wrap: Callable = _compile if compiled else (lambda f: f)
        self.compiled, self.elementwise = compiled, elementwise
        self.rms, self.add_rms, self.qk_rope, self.silu_mul = map(wrap, (rms, add_rms, qk_rope, silu_mul))
        self.prologue = self.split_attention = None
        self.project, self.matmul = _project, cpu_linear.linear  # F.linear but where a CPU product is faster on oneDNN
        if prologue or split_attention or elementwise:
            from draftflow.layers import triton_kernels

            self.prologue = triton_kernels.qk_rope_write if prologue else None
            self.split_attention = triton_kernels.decode_attention if split_attention else None
            if elementwise:
                self._use_triton_elementwise(triton_kernels)

    def _use_triton_elementwise(self, tk) -> None:
        plain_rms, plain_add_rms, plain_silu_mul = self.rms, self.add_rms, self.silu_mul

        def rows_ok(*ts: torch.Tensor) -> bool:
            return all(t.is_cuda and t.dtype in (torch.float32, torch.bfloat16) and t.is_contiguous() for t in ts)

        def rms_(x, weight, eps, offset=False):
            return tk.add_rms(x, None, weight, eps, offset)[1] if rows_ok(x) else plain_rms(x, weight, eps, offset)

        def add_rms_(x, delta, weight, eps, offset=False):
            return tk.add_rms(x, delta, weight, eps, offset) if rows_ok(x, delta) else plain_add_rms(x, delta, weight, eps, offset)

        def silu_mul_(gate, up):
            # gate, up: [.., I] row views with one row stride (two halves of one product, or two contiguous tensors)
            uniform = (gate.stride() == up.stride() and gate.stride(-1) == 1 and gate.dim() >= 2
                       and all(gate.stride(d) == gate.shape[d + 1] * gate.stride(d + 1) for d in range(gate.dim() - 2)))
            if uniform and gate.is_cuda and gate.dtype in (torch.float32, torch.bfloat16) and up.dtype == gate.dtype:
                return tk.silu_mul(gate, up)
            return plain_silu_mul(gate, up)

        from draftflow.layers import gemv

        def matmul_(x, weight, bias=None):
            if bias is None and x.is_cuda and gemv.fits(x, weight) and gemv.prefer(weight):
                return gemv.linear(x, weight)
            return F.linear(x, weight, bias)

        def project_(linear, x):
            return matmul_(x, linear.weight, linear.bias) if type(linear) is nn.Linear else linear(x)

        self.rms, self.add_rms, self.silu_mul, self.project, self.matmul = rms_, add_rms_, silu_mul_, project_, matmul_


def _project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # A projection (o_proj, down_proj): the module itself (the Triton elementwise kernels may take one-row products)
    return cpu_linear.linear(x, linear.weight, linear.bias) if type(linear) is nn.Linear else linear(x)


PLAIN = Kernels()


# --- weight layout ---------------------------------------------------------------------------
def fuse_projections(model: nn.Module) -> None:
    """Store each attention layer's q/k/v weights (and biases) in one tensor, and each dense MLP's gate/up in another.

    The parameters stay the model's own: each becomes a row-slice view of its group's
    tensor, so every forward computes exactly what it did and no weight is duplicated
    (one group's worth is allocated transiently). Linear-attention and MoE layers are left
    as they are. Idempotent.
    """
    for layer in model.layers:
        attn, mlp = getattr(layer, "self_attn", None), layer.mlp
        if attn is not None:
            _rehome([attn.q_proj, attn.k_proj, attn.v_proj])
        if hasattr(mlp, "gate_proj"):
            _rehome([mlp.gate_proj, mlp.up_proj])


def joined(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The tensors as one `[sum of rows, ...]` view if they lie back to back in one storage, else None."""
    first = tensors[0]
    if first is None:
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return None  # a view of the first tensor would route every gradient to it alone
    offset = first.storage_offset()
    for t in tensors:
        adjacent = (t is not None and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                    and t.storage_offset() == offset)
        if not (adjacent and t.is_contiguous() and t.shape[1:] == first.shape[1:]):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def fused_linear(x: torch.Tensor, linears: Sequence[nn.Module], matmul: Callable = F.linear) -> torch.Tensor | None:
    """x times the linears' stacked weights as one product ([..., sum of outputs]); None when they are not fused.

    nn.Linear: one F.linear when `fuse_projections` put the weights back to back. QuantLinear
    (GGUF weights kept quantized, quant_linear.py): one kernel when the blocks lie back to back
    in one type, else one per run of one type into column slices of one output (Q4_K_M stores
    attn_v as Q6_K next to Q4_K q/k in half its layers: one kernel for q/k, one for v), so the
    fused consumers (the Triton prologue) still get one tensor.
    """
    first = linears[0]
    qtypes = {getattr(lin, "qtype", None) for lin in linears}
    if qtypes == {None}:
        weight = joined([lin.weight for lin in linears])
        has_bias = first.bias is not None
        bias = joined([lin.bias for lin in linears]) if has_bias else None
        return matmul(x, weight, bias) if weight is not None and (bias is not None or not has_bias) else None
    if None in qtypes:
        return None  # some dequantized at load (a type the kernels do not cover): separate products
    if len(qtypes) == 1:
        data = joined([lin.data for lin in linears])  # joins only one layout: _rehome joined that attribute
        bias = joined([lin.bias for lin in linears]) if first.bias is not None else None
        if data is not None and (bias is not None or first.bias is None):
            return first.product(x, data, bias)
    width = sum(lin.out_features for lin in linears)
    out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)  # [..., sum of outputs]
    rows, col = out.view(-1, width), 0
    for run in _runs(linears):  # one kernel per run of one type whose blocks lie back to back (_rehome), else per layer
        data = joined([lin.data for lin in run])
        bias = joined([lin.bias for lin in run]) if run[0].bias is not None else None
        joint = data is not None and (bias is not None or run[0].bias is None)
        for lin, data, bias in [(run[0], data, bias)] if joint else [(m, m.data, m.bias) for m in run]:
            span = sum(m.out_features for m in run) if joint else lin.out_features
            lin.product(x, data, bias, out=rows[:, col:col + span])
            col += span
    return out


def _runs(linears: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """The linears split into runs of consecutive ones of one type (q/k Q4_K, then v Q6_K: two runs)."""
    runs: list[list[nn.Module]] = []
    for lin in linears:
        if runs and getattr(runs[-1][0], "qtype", None) == getattr(lin, "qtype", None):
            runs[-1].append(lin)
        else:
            runs.append([lin])
    return runs


def _rehome(linears: list[nn.Module]) -> None:
    qtypes = {getattr(lin, "qtype", None) for lin in linears}
    if len(qtypes) > 1:
        if None not in qtypes:  # mixed kept types: join each run of one type (Q4_K_M's q/k beside a Q6_K v)
            for run in _runs(linears):
                if len(run) > 1:
                    _rehome(run)
        return  # fused_linear runs one product per run (one per layer where a run is dequantized)
    quantized = qtypes != {None}
    for attr in ("blocks", "packed", "bias") if quantized else ("weight", "bias"):  # packed: quant_repack's rows
        parts = [getattr(lin, attr) for lin in linears]
        if any(p is None for p in parts) or joined(parts) is not None:
            continue
        group = torch.cat([p.detach() for p in parts])
        row = 0
        for lin, p in zip(linears, parts):
            part = group[row:row + p.shape[0]]  # QuantLinear.blocks / .packed are buffers, not parameters
            setattr(lin, attr, part if attr in ("blocks", "packed") else nn.Parameter(part, requires_grad=False))
            row += p.shape[0]
