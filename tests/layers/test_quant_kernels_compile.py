"""The quantized GEMV kernels compile for sm_90 (H100 / H200) on a machine without a GPU, without spills.

The interpreter tests run the kernels' arithmetic but not Triton's compiler. This compiles the
split-K GEMV (layers/quant_gemv.py) at Qwen3-8B row widths with the tiles `plan` picks, specialised
as the launcher specialises them at run time (pointers, widths and strides divisible by 16), to
cubins in a subprocess (without TRITON_INTERPRET), and reads the registers and local memory of each
with the cuobjdump Triton ships: no spills (local memory), and no quarter-rate I2F conversion per
weight (the dequantization converts its integers with float adds).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import os, re, subprocess, sys, tempfile
import torch
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.errors import CompilationError
except ImportError as exc:
    print(f"triton API differs: {exc}"); sys.exit(3)
from draftflow.layers import quant_gemv as qg, quant_kernels as qk

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
DIV16 = ("N", "row_bytes", "n_blocks", "stride_xm", "stride_om")

def compile_(fn, types, consts, warps):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    div = {(j,): [["tt.divisibility", 16]] for j, n in enumerate(fn.arg_names)
           if n not in consts and (n.endswith("_ptr") or n in DIV16)}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=div),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    except CompilationError:
        raise
    except Exception as exc:  # an API change (signature format, options), not the kernel: skip
        print(f"triton API differs: {type(exc).__name__}: {exc}"); sys.exit(3)
    if not os.path.exists(CUOBJDUMP):
        return "?", "?", "?"
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs, local = re.search(r"REG:(\d+)", res).group(1), re.search(r"LOCAL:(\d+)", res).group(1)
    return regs, local, len(re.findall(r"\bI2F", sass))

def gemv(qtype, m, k, xdt):
    n_blocks = k // qk.LAYOUT[qtype][0]
    use_dot = m >= qg.DOT_MIN_ROWS
    block_n, warps = qg.tile(m, torch.float32 if xdt == "*fp32" else torch.bfloat16)
    bm = max(16, triton.next_power_of_2(m)) if use_dot else triton.next_power_of_2(m)
    types = {"x_ptr": xdt, "w_ptr": "*u8", "bias_ptr": xdt, "out_ptr": xdt, "part_ptr": "*fp32"}
    dtype = torch.float32 if xdt == "*fp32" else torch.bfloat16
    consts = dict(qg.meta(qtype, n_blocks, m, dtype), BLOCK_M=bm, BLOCK_N=block_n, USE_DOT=use_dot,
                  IEEE=xdt == "*fp32", NATIVE=True, DIRECT=False, HAS_BIAS=False, OUT_BF16=xdt == "*bf16")
    return compile_(qg._gemv_kernel, types, consts, warps)

for qtype, m, k, xdt in (("Q4_K", 1, 4096, "*bf16"), ("Q8_0", 1, 12288, "*bf16"),
                         ("Q4_K", 16, 4096, "*bf16"), ("Q6_K", 33, 4096, "*fp32")):
    print("gemv", qtype, m, xdt, *gemv(qtype, m, k, xdt))
print("reduce", *compile_(qg._reduce_kernel, {"part_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16"},
                          dict(SPLIT=4, BLOCK=qg.REDUCE_BLOCK, HAS_BIAS=True, OUT_BF16=True), 4))
print("compiled")
"""


def test_gemv_kernels_compile_for_sm90_without_spills():
    """The GEMV at 1 row (multiply-adds), 16 rows (bf16 tl.dot), 33 rows (float32 IEEE dot) and the partials'
    reduction compile to sm_90 cubins with no local memory (spills) and no I2F instruction."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0 and "compiled" in done.stdout, done.stdout + done.stderr[-3000:]
    for line in done.stdout.splitlines()[:-1]:
        *case, regs, local, i2f = line.split()
        assert local in ("0", "?") and i2f in ("0", "?"), \
            f"{' '.join(case)}: {regs} registers, {local} B local, {i2f} I2F"
    print(done.stdout)
