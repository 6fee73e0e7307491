"""The quantized GEMV kernels compile for sm_90 (H100 / H200) on a machine without a GPU, without spills.

The interpreter tests run the kernels' arithmetic but not Triton's compiler. This compiles the
split-K GEMV (layers/quant_gemv.py) at Qwen3-8B row widths with the tiles `plan` picks, specialised
as the launcher specialises them at run time (pointers, widths and strides divisible by 16), to
cubins in a subprocess (without TRITON_INTERPRET), and reads the registers and local memory of each
with the cuobjdump Triton ships: no spills (local memory), and no quarter-rate I2F conversion per
weight (the dequantization converts its integers with float adds).
"""

from __future__ import annotations

import pytest
from sm90_compile import run

pytest.importorskip("triton")

BODY = r"""
from draftflow.layers import quant_gemv as qg, quant_kernels as qk

DIV16 = ("N", "row_bytes", "n_blocks", "stride_xm", "stride_om")

def gemv(qtype, m, k, xdt):
    n_blocks = k // qk.LAYOUT[qtype][0]
    use_dot = m >= qg.DOT_MIN_ROWS
    block_n, warps = qg.tile(m, torch.float32 if xdt == "*fp32" else torch.bfloat16)
    bm = max(16, triton.next_power_of_2(m)) if use_dot else triton.next_power_of_2(m)
    types = {"x_ptr": xdt, "w_ptr": "*u8", "bias_ptr": xdt, "out_ptr": xdt, "part_ptr": "*fp32"}
    dtype = torch.float32 if xdt == "*fp32" else torch.bfloat16
    consts = dict(qg.meta(qtype, n_blocks, m, dtype), BLOCK_M=bm, BLOCK_N=block_n, USE_DOT=use_dot,
                  IEEE=xdt == "*fp32", NATIVE=True, DIRECT=False, HAS_BIAS=False, OUT_BF16=xdt == "*bf16")
    regs, local, sass = compile_(qg._gemv_kernel, types, consts, warps, DIV16)
    return regs, local, len(re.findall(r"\bI2F", sass))

for qtype, m, k, xdt in (("Q4_K", 1, 4096, "*bf16"), ("Q8_0", 1, 12288, "*bf16"),
                         ("Q4_K", 16, 4096, "*bf16"), ("Q6_K", 33, 4096, "*fp32")):
    print("gemv", qtype, m, xdt, *gemv(qtype, m, k, xdt))
regs, local, sass = compile_(qg._reduce_kernel, {"part_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16"},
                             dict(SPLIT=4, BLOCK=qg.REDUCE_BLOCK, HAS_BIAS=True, OUT_BF16=True), 4, DIV16)
print("reduce", regs, local, len(re.findall(r"\bI2F", sass)))
print("compiled")
"""


def test_gemv_kernels_compile_for_sm90_without_spills():
    """The GEMV at 1 row (multiply-adds), 16 rows (bf16 tl.dot), 33 rows (float32 IEEE dot) and the partials'
    reduction compile to sm_90 cubins with no local memory (spills) and no I2F instruction."""
    for line in run(BODY):
        *case, regs, local, i2f = line.split()
        assert local == "0" and i2f == "0", f"{' '.join(case)}: {regs} registers, {local} B local, {i2f} I2F"
