"""The fused MoE kernels compile for sm_90 (H100 / H200) on a machine without a GPU.

The interpreter tests run the kernels' arithmetic but not Triton's compiler, which rejects
things the interpreter accepts (a pointer chosen in a runtime branch, loop-carried types).
This compiles each kernel at the Qwen3-30B-A3B routing shape (128 experts, top-8) to a cubin
in a subprocess (without TRITON_INTERPRET), so CI catches such errors before the GPU run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import sys
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.errors import CompilationError
except ImportError as exc:
    print(f"triton API differs: {exc}"); sys.exit(3)
from draftflow.layers import moe_few_token as few
from draftflow.layers import moe_kernels as mk
from draftflow.layers import moe_router as router
import torch
device = torch.device("cuda")  # small_config: an H200's 132 multiprocessors when no GPU answers
from draftflow.layers import triton_kernels as tk
tk._SMS.setdefault(0, 132)
torch.cuda.current_device = lambda: 0

import os, subprocess, tempfile
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

def usage(kernel):
    # registers and local memory (spills) of a compiled kernel, from its cubin
    if not os.path.exists(CUOBJDUMP):
        return "no cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"]); f.flush()
        text = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = [line.strip() for line in text.splitlines() if "REG:" in line]
    return found[-1] if found else "no usage"

def compile_(fn, types, consts, warps, specialised=True, report=False):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    # What the launcher specialises at run time (30B-A3B shapes): aligned pointers, widths and strides by 16, so
    # the weight loads are pipelined (asynchronous copies) as they will be on the GPU.
    div = {(j,): [["tt.divisibility", 16]] for j, n in enumerate(fn.arg_names)
           if n not in consts and (n.endswith("_ptr") or n in ("H", "I", "stride_slot", "stride_host", "CHUNK"))}
    try:
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=div if specialised else None),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    except CompilationError:
        raise
    except Exception as exc:  # an API change (signature format, options), not the kernel: skip
        print(f"triton API differs: {type(exc).__name__}: {exc}"); sys.exit(3)
    if report:
        stats = usage(kernel)
        print(fn.__name__, {k: v for k, v in consts.items() if k.startswith(("BLOCK", "SPLIT"))}, stats)
        assert "LOCAL:0" in stats or stats.startswith("no "), f"{fn.__name__} spills: {stats}"

for dt in ("bf16", "fp32"):
    ptrs = {n: "*" + dt for n in ("logits_ptr", "x_ptr", "w_ptr", "host_ptr", "act_ptr", "y_ptr", "out_ptr",
                                  "route_w_ptr", "res_ptr", "nw_ptr", "sum_ptr", "normed_ptr", "d_ptr", "gw_ptr")}
    types = {**ptrs, "ids_ptr": "*i64", "slot_ptr": "*i64", "tally_ptr": "*i32", "count_ptr": "*i32",
             "part_ptr": "*fp32", "z_ptr": "*fp32", "logit_ptr": "*fp32", "eps": "fp32"}
    # The few-token kernels at the configs small_config picks (1, 2, 4 and 8 tokens at top-8 of 128, H 2048,
    # I 768): registers and spills printed (pytest -s), no spills asserted
    for tokens, pairs in ((1, 8), (2, 16), (4, 32), (8, 32)) if dt == "bf16" else ((1, 8),):
        block_i, split, block_n = mk.small_config(tokens, pairs, 2048, 768, device)
        small = dict(K=pairs // tokens, BLOCK_T=tokens, BLOCK_KP=pairs // tokens, IS_BF16=dt == "bf16")
        compile_(few._gate_up_small_kernel, types, dict(small, BLOCK_I=block_i, BLOCK_H=256, SPLIT=split), 4,
                 report=True)
        compile_(few._down_small_kernel, types, dict(small, BLOCK_N=block_n, BLOCK_J=256), 4, report=True)
    compile_(router._route_kernel, types, dict(K=8, BLOCK_E=128, BLOCK_K=8, NORM=True), 1)
    for add_rms in (False, True):  # the fused router at the 30B shape (E 128, H 2048), alone and with the norm
        compile_(router._router_kernel, types, dict(K=8, BLOCK_E=2, BLOCK_H=2048, BLOCK_ALL=128, BLOCK_K=8, NORM=True,
                                                IS_BF16=dt == "bf16", ADD_RMS=add_rms, OFFSET=False), 4, report=True)
    compile_(mk._combine_kernel, types, dict(K=8, BLOCK=1024, IS_BF16=dt == "bf16"), 4)
    # (constants, columns, warps, specialised): bf16 decode (Triton makes N == 1 a constant), 16-token windows by
    # pair at both default widths and the sweep's widest, a 33-token window by expert (also with odd widths);
    # float32 as the CUDA tests run it (odd widths)
    variants = [(dict(N=1, BLOCK_T=16, BY_PAIR=True), 16, 4, True), (dict(BLOCK_T=16, BY_PAIR=True), 32, 4, True),
                (dict(BLOCK_T=16, BY_PAIR=True), 64, 8, True), (dict(BLOCK_T=64, BY_PAIR=False), 32, 4, True),
                (dict(BLOCK_T=64, BY_PAIR=False), 32, 4, False)] if dt == "bf16" else \
               [(dict(BLOCK_T=16, BY_PAIR=True), 16, 4, False)]
    for extra, cols, warps, specialised in variants:
        consts = dict(extra, K=8, BLOCK_KP=8, IS_FP32=dt == "fp32")
        compile_(mk._gate_up_kernel, types, dict(consts, BLOCK_I=cols, BLOCK_H=128, IS_BF16=dt == "bf16"), warps,
                 specialised)
        compile_(mk._down_kernel, types, dict(consts, BLOCK_N=cols, BLOCK_I=128), warps, specialised)
print("compiled")
"""


def test_kernels_compile_for_sm90():
    """route_topk, the fused router, gate/up, down and combine, and the few-token kernels (no spills) compile to sm_90 cubins: bf16 decode, 16- and 33-token windows (by pair
    and by expert, with the host-memory branch for misses; pipelined as specialised at run time, and unspecialised),
    and float32."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0 and "compiled" in done.stdout, done.stdout + done.stderr[-3000:]
    print(done.stdout)
