"""The repacked GEMV (layers/quant_gemv_repacked.py) compiles for sm_90 without a GPU: no spills, under 128 registers,
no I2F, and few instructions per weight in its main loop.

The interpreter tests run the arithmetic but not Triton's compiler. This compiles the GEMV with the tiles `plan`
picks, specialised as the launcher specialises it (pointers, widths and strides divisible by 16), to cubins in a
subprocess (without TRITON_INTERPRET), and reads each cubin with the cuobjdump Triton ships. The loop budget is
what makes a 4-bit GEMV memory-bound on an H200: ~32 weights per SM-clock arrive at copy bandwidth, and an SM issues
128 instructions a clock, so a Q4_K weight may cost about 4 instructions at one row.
"""

from __future__ import annotations

import pytest
from sm90_compile import run

pytest.importorskip("triton")

BODY = r"""
from draftflow.layers import quant_gemv_repacked as rg
from draftflow.layers.quant_repack import SPEC

DIV16 = ("N", "row_words", "goff", "soff", "n_units", "per_split", "stride_xm", "stride_om", "magic")

def loop(sass):
    # the longest backward branch's body: the K loop
    code = [(int(a, 16), i) for a, i in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = []
    for a, ins in code:
        m = re.search(r"BRA (0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < a:
            body = [i for b, i in code if int(m.group(1), 16) <= b <= a]
            best = body if len(body) > len(best) else best
    return best

for qtype, m, xdt in (("Q4_K", 1, "*bf16"), ("Q6_K", 1, "*bf16"), ("Q8_0", 1, "*bf16"), ("Q4_K", 16, "*bf16"),
                      ("Q4_K", 20, "*bf16"), ("Q4_K", 33, "*bf16"), ("Q6_K", 33, "*fp32")):
    dtype = torch.float32 if xdt == "*fp32" else torch.bfloat16
    bn, u, warps = rg.tile(m, dtype)
    use_dot = m >= rg.DOT_MIN_ROWS
    bm = max(16, triton.next_power_of_2(m)) if use_dot else 1
    types = {"x_ptr": xdt, "w_ptr": "*i32", "b8_ptr": "*u8", "h_ptr": "*fp16", "bias_ptr": xdt, "out_ptr": xdt,
             "part_ptr": "*fp32", "count_ptr": "*i32"}
    consts = dict(QTYPE=rg._CODE[qtype], BITS=SPEC[qtype][0], U=u, BLOCK_M=bm, BLOCK_N=bn, USE_DOT=use_dot,
                  IEEE=xdt == "*fp32", NATIVE=True, DIRECT=False, HAS_BIAS=False, OUT_BF16=xdt == "*bf16",
                  EVEN=True, SWAP=m <= rg.SWAP_MAX_ROWS and xdt != "*fp32",
                  FUSED=m <= rg.FUSED_MAX_ROWS, PREFETCH=False, STAGES=rg.STAGES)
    regs, local, sass = compile_(rg._gemv_kernel, types, consts, warps, DIV16)
    body = loop(sass)
    weights = bn * u * 128 // SPEC[qtype][0] / (warps * 32)  # per thread per loop step
    print(qtype, m, xdt, regs, local, len(re.findall(r"\bI2F", sass)), f"{len(body) / weights:.2f}")

from draftflow.layers import quant_gemv_rows as qr
for qtype in ("Q4_K", "Q6_K", "Q8_0"):  # the one-row kernel with the activations in registers (m = 1 by default)
  for int8 in (0, 1, 2):  # float multiply-adds; int8 activations, one and two terms (dp4a)
    types = {"x_ptr": "*bf16", "w_ptr": "*i32", "b8_ptr": "*u8", "h_ptr": "*fp16", "bias_ptr": "*bf16",
             "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
    bn = (qr.INT8_BLOCK_N if int8 else qr.BLOCK_N)[SPEC[qtype][0]]
    consts = dict(QTYPE=rg._CODE[qtype], BITS=SPEC[qtype][0], U=qr.UNITS, BLOCK_N=bn, HAS_BIAS=False,
                  OUT_BF16=True, EVEN=True, DIRECT=False, PDL=True, STAGES=qr.STAGES[SPEC[qtype][0]], INT8=int8,
                  NATIVE=True, PREFETCH=bool(int8) and qr.INT8_PREFETCH[SPEC[qtype][0]])
    regs, local, sass = compile_(qr._gemv_rows_kernel, types, consts, qr.WARPS, ("N", "row_words", "goff", "soff",
                                                                                "n_units", "magic"),
                                 qr.INT8_MAXNREG[SPEC[qtype][0]] if int8 else None)
    weights = bn * qr.UNITS * 128 // SPEC[qtype][0] / (qr.WARPS * 32)
    body = loop(sass)
    # int8: one I2F per (row, unit) of integer sums is allowed; none per weight (I2F per weight is checked elsewhere)
    i2f = len(re.findall(r"\bI2F", "\n".join(body))) - (bn * qr.UNITS // (qr.WARPS * 32) if int8 else 0)
    # the dp4a the codes need: a word's two nibble halves (4-bit) or its bytes (8-bit), once per term
    want_idp = bn * qr.UNITS * 4 // (qr.WARPS * 32) * (2 if SPEC[qtype][0] == 4 else 1) * int8
    print(qtype, "rows" + (f"-int8x{int8}" if int8 else ""), "*bf16", regs, local, max(i2f, 0) if int8 else
          len(re.findall(r"\bI2F", sass)), f"{len(body) / weights:.2f}", len(re.findall(r"\bIDP", "\n".join(body))),
          want_idp)
print("compiled")
"""

# Instructions per weight and thread in the main loop (sm_90, bf16 activations), as compiled on 2026-12-01 with
# Triton 3.9: Q4_K 1 row 4.6, Q6_K / Q8_0 1 row 5.3 / 5.1 (memory-bound at 8 bits); the rows kernel (quant_gemv_rows,
# the default at one row) Q4_K / Q6_K / Q8_0 4.6 / 5.4 / 6.1. Q4_K 16 / 20 / 33 rows: 6.3 / 6.5 / 6.5 while the K loop
# was a plain `range` (Triton then pipelined it by the launch's default num_stages, 3), 5.4 / 5.5 / 5.8 since it is
# `tl.range(num_stages=STAGES)` with STAGES 1 (2026-12-04; Triton 3.6: 7.3 / 7.6 / 7.7 -> 6.8 / 6.9 / 7.2).
# With int8 activations (two terms, 16 rows a step, dp4a; 2026-12-05, Triton 3.9): Q4_K / Q6_K / Q8_0 2.6 / 2.9 / 3.2
# (one term: Q4_K 2.3); the float path at the same commit: 5.0 / 5.4 / 6.0. Since 2026-12-06 4-bit int8 takes 8 rows a
# step under a cap of 80 registers (INT8_MAXNREG): Q4_K 2.56, 64 registers. Since 2026-12-06 (nineteenth session) the
# int8 loop loads the next step's codes before computing (INT8_PREFETCH, cap 96): Q4_K / Q6_K / Q8_0 2.69 / 3.08 / 3.53
# at 80 / 56 / 48 registers (one term: 2.34 / 2.66 / 3.16).
BUDGET = {("Q4_K", "rows-int8x2"): 3.0, ("Q4_K", "rows-int8x1"): 2.6, ("Q6_K", "rows-int8x2"): 3.3,
          ("Q8_0", "rows-int8x2"): 3.7, ("Q4_K", "rows"): 5.0, ("Q6_K", "rows"): 6.0, ("Q8_0", "rows"): 6.5,
          ("Q4_K", "1"): 5.0, ("Q6_K", "1"): 6.0, ("Q8_0", "1"): 5.6, ("Q4_K", "16"): 6.0, ("Q4_K", "20"): 6.0,
          ("Q4_K", "33"): 6.2}


def test_repacked_gemv_compiles_for_sm90_within_budget():
    """One row (factored multiply-adds), 16 and 20 rows (bf16 dot, weight as A, fused reduction), 33 rows (bf16 dot,
    x as A) and float32 33 rows: no local memory, <= 128 registers, no I2F, the loop within BUDGET per weight. The
    rows kernel with int8 activations: one I2F per (row, unit) sum and none per weight, and the dp4a count the codes
    need (2 a 4-bit word and term, 1 an 8-bit word and term)."""
    for line in run(BODY):
        qtype, m, xdt, regs, local, i2f, per_weight, *idp = line.split()
        if m.startswith("rows-int8"):  # the codes' products are dp4a, as many as BODY derives from the tile
            assert idp[0] == idp[1], line
        case = f"{qtype} {m} rows {xdt}: {regs} registers, {local} B local, {i2f} I2F, {per_weight} instructions/weight"
        assert local == "0" and int(regs) <= 128 and i2f == "0", case
        assert float(per_weight) <= BUDGET.get((qtype, m), 1e9), case
