"""Compile Triton kernels for sm_90 (H100 / H200) on a machine without a GPU, and read the cubins.

The interpreter tests run kernels' arithmetic but not Triton's compiler. A compile test writes a script body that
calls ``compile_(fn, types, consts, warps, div16=())`` for each kernel and prints one line per case, then
``print("compiled")``; ``run(body)`` runs PRELUDE + body in a subprocess without TRITON_INTERPRET and returns the
case lines. ``compile_`` returns (registers, local bytes, SASS text) read with the cuobjdump Triton ships; an API
difference of the installed Triton (or no cuobjdump) makes the test skip, a compile error fails it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PRELUDE = r"""
import os, re, subprocess, sys, tempfile
import torch
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.errors import CompilationError
except ImportError as exc:
    print(f"triton API differs: {exc}"); sys.exit(3)

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

def compile_(fn, types, consts, warps, div16=(), maxnreg=None):
    # pointers and the `div16` integer arguments are specialised as divisible by 16, as the launcher does
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    div = {(j,): [["tt.divisibility", 16]] for j, n in enumerate(fn.arg_names)
           if n not in consts and (n.endswith("_ptr") or n in div16)}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=div),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})})
    except CompilationError:
        raise
    except Exception as exc:  # an API change (signature format, options), not the kernel: skip
        print(f"triton API differs: {type(exc).__name__}: {exc}"); sys.exit(3)
    if not os.path.exists(CUOBJDUMP):
        print("no cuobjdump in this triton"); sys.exit(3)
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    return int(re.search(r"REG:(\d+)", res).group(1)), int(re.search(r"LOCAL:(\d+)", res).group(1)), sass
"""


def run(body: str, timeout: int = 300) -> list[str]:
    """PRELUDE + ``body`` in a subprocess (no TRITON_INTERPRET): its printed case lines; skips on an API change."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, env=env,
                          timeout=timeout)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0 and "compiled" in done.stdout, done.stdout + done.stderr[-3000:]
    print(done.stdout)
    return done.stdout.splitlines()[:-1]
