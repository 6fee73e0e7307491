"""DFlash2's grouped dynamic convolution as one Triton kernel (the block path on CUDA, `DFlashModel.use_triton`).

The plain ops are four launches a convolution at kernel size 2 (the coefficients, the first
tap, the shifted input, the second tap), and a DFlash2 block forward convolves four times a
layer. Here one program per block row computes, for every channel c,
out[i, c] = sum over taps t <= i of (base[t, c] + dynamic[i, t, group(c)]) * z[i - t, c],
rounding where the plain ops round (the coefficient; the first product; each later tap's
multiply-add, as `addcmul` does it), so bfloat16 follows them. Imported only where used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftflow.layers.triton_kernels import round_like, pdl, pdl_enter


@triton.jit
def _conv_kernel(z_ptr, dyn_ptr, base_ptr, out_ptr, W, H, stride_dyn, GROUP: tl.constexpr, TAPS: tl.constexpr,
                 BLOCK: tl.constexpr, IS_BF16: tl.constexpr, PDL: tl.constexpr = False):
    # z, out: [N*W, H] (N blocks of W rows); dyn: row r's tap t of group g at r * stride_dyn + t * (H / GROUP) + g;
    # base: [TAPS, H]
    pdl_enter(PDL)
    row = tl.program_id(0)
    w = row % W
    cols = tl.arange(0, BLOCK)
    live = cols < H
    groups = H // GROUP
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for t in tl.static_range(TAPS):
        seen = live & (cols * 0 + w >= t)  # rows before the block's first see zero padding
        base = tl.load(base_ptr + t * H + cols, mask=live, other=0.0).to(tl.float32)
        dyn = tl.load(dyn_ptr + row * stride_dyn + t * groups + cols // GROUP, mask=live, other=0.0).to(tl.float32)
        coef = round_like(base + dyn, IS_BF16)
        z = tl.load(z_ptr + (row - t) * H + cols, mask=seen, other=0.0).to(tl.float32)
        if t == 0:
            acc = round_like(coef * z, IS_BF16)
        else:
            acc = round_like(acc + coef * z, IS_BF16)
    tl.store(out_ptr + row * H + cols, acc.to(out_ptr.dtype.element_ty), mask=live)


def grouped_dynamic_conv(z: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """`GroupedDynamicConv._convolve`: z [N, W, H] (contiguous), dynamic [N, W, K, groups] (unit stride over taps and
    groups, any row stride), base [K, H]; returns [N, W, H] in z's dtype."""
    n, w, h = z.shape
    taps = base.shape[0]
    out = torch.empty_like(z)
    _conv_kernel[(n * w,)](
        z, dynamic, base.to(z.dtype).contiguous(), out, w, h, dynamic.stride(1), GROUP=group_size, TAPS=taps,
        BLOCK=triton.next_power_of_2(h), IS_BF16=z.dtype == torch.bfloat16, num_warps=4, **pdl(z.device),
    )
    return out
