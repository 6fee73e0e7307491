"""Per-projection kernel timings and tile sweeps for benchmarks/gpu_quant.py (issue 20).

At the four fused projection shapes of the benchmark's model: cuBLAS's bf16 product, the file-layout GEMV
(quant_gemv) and the repacked one (quant_gemv_repacked, and at one row the activation-stationary rows kernel of
quant_gemv_rows) per quantization type at 1 and 16 rows, each a CUDA graph of 20 calls (device time, not Python's
launch overhead); optional sweeps of their tiles, register caps, pipelining stages and int8 terms; and the picks of
the best tiles for gpu_quant.py to re-run the step with. GPU-only in what it measures; on the CPU (`--tiny`) it runs
through Triton's interpreter and measures nothing.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_target as gt  # noqa: E402  (timers, the device)

# fp16 scale fields per block (byte offset, magnitude): |w| stays below ~0.1 whatever the random quant bytes are
SCALES = {"Q8_0": ((0, 5e-4),), "Q4_0": ((0, 1e-2),), "Q4_1": ((0, 5e-3), (2, 4e-2)), "Q5_0": ((0, 5e-3),),
          "Q5_1": ((0, 3e-3), (2, 5e-2)), "Q4_K": ((0, 1e-4), (2, 1e-3)), "Q5_K": ((0, 5e-5), (2, 1e-3)),
          "Q6_K": ((208, 2e-5),)}
SWEEP = ((2, 1), (4, 1), (8, 1), (8, 2), (16, 2), (16, 4), (32, 4))  # (BLOCK_N, warps) of the float32-FMA GEMV
SWEEP_DOT = ((16, 4), (32, 4), (64, 4), (64, 8))  # of the tensor-core GEMV (16 rows)
# (BLOCK_N, units, warps, split, prefetch; None: the plan's) of the repacked GEMV at one row (Q4_K): tiles, splits,
# loading the next step's tile during this one (Q8_0 and Q6_K try only that: they are memory-bound)
SWEEP_REPACKED = ((32, 8, 2, None, False), (64, 16, 4, None, False), (128, 8, 4, None, False), (32, 8, 4, None, False),
                  (64, 8, 4, 4, False), (64, 8, 4, 8, False), (64, 8, 4, 16, False), (64, 8, 4, None, True))
# (rows a loop step, ptxas register cap) of the one-row rows kernel for --rows-sweep: Triton 3.6 compiles 16 rows of
# 4-bit codes to 215 registers (2 programs an SM), 8 rows to 117, 4 rows to 56 (sm_90 compile, 2026-12-01)
ROWS_SWEEP = ((4, None), (8, None), (16, None), (16, 128), (8, 96))
# --stages-sweep: loop steps in flight (tl.range's pipelining) for the rows kernel as (rows a step or None for its
# default, stages), and for the 16-row window's kernel (quant_gemv_repacked, its plan's tile)
STAGES_SWEEP = ((None, 2), (None, 3), (None, 4), (16, 2), (4, 4))
WINDOW_STAGES = (2, 3, 4)
# --int8-sweep: (rows a step or None for the default, int8 terms) of the rows kernel with 16-bit activations: float
# multiply-adds (0) against the activations as one or two int8 terms with dp4a (layers/quant_gemv_rows.py)
INT8_SWEEP = ((None, 0), (8, 0), (None, 1), (8, 1), (8, 2), (16, 2), (32, 2), (32, 1))


def random_blocks(qtype: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[n, row bytes] uint8 on the device: random quant bytes in `qtype`'s block layout, finite small scales."""
    from draftflow.layers.quant_linear import LAYOUT

    block, size = LAYOUT[qtype]
    data = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8, device=gt.DEV, generator=gen)
    for at, mag in SCALES[qtype]:
        u = torch.rand(n, k // block, device=gt.DEV, generator=gen)
        scale = (mag * (0.5 + 0.5 * u) * torch.where(u > 0.5, 1.0, -1.0)).to(torch.float16)
        data[:, :, at:at + 2] = scale.view(torch.uint8).view(n, k // block, 2)
    return data.view(n, k // block * size)


def kernel_ms(fn, reps: int, rounds: int, inner: int = 20) -> float:
    """Device time of one fn() call: a CUDA graph of `inner` calls replayed (so Python's launch overhead, which an eager
    loop would time for these 5-50 us kernels, is not counted); eager on the CPU or if the capture fails."""
    if gt.DEV != "cuda":
        return gt.cuda_ms(fn, reps, rounds)
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    except Exception as exc:  # noqa: BLE001 (a timing fallback, reported)
        print(f"graph capture failed ({type(exc).__name__}: {exc}); timing eagerly", file=sys.stderr)
        return gt.cuda_ms(fn, reps, rounds)
    graph.replay()
    return gt.cuda_ms(graph.replay, max(1, reps // 5), rounds) / inner


def projections(cfg, a, totals: dict) -> dict:
    """Per fused projection shape: cuBLAS bf16 vs the file-layout GEMV vs the repacked GEMV per type at 1 and 16 rows,
    GB/s of the weight bytes each reads (the repacked one also over the file's bytes, `file_GBps`).

    `totals` gathers each swept tile's time summed over shapes and types: {(tensor cores?, tile): [us, count]}."""
    from draftflow.layers.quant_gemv import DOT_MIN_ROWS, gemv, plan

    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}
    from draftflow.layers.quant_linear import LAYOUT

    gen = torch.Generator(device=gt.DEV).manual_seed(5)
    reps, out = (50 if not a.tiny else 1), {}
    for name, (n, k) in shapes.items():
        row = out[f"{name} [{n}x{k}]"] = {}
        w = torch.randn(n, k, device=gt.DEV, generator=gen).to(torch.bfloat16)
        for m in (1, 16):
            x = torch.randn(m, k, device=gt.DEV, dtype=torch.bfloat16)
            ms = kernel_ms(lambda: F.linear(x, w), reps, a.rounds)
            row[f"bf16 cuBLAS m={m}"] = {"us": ms * 1e3, "GBps": w.nbytes / ms / 1e6}
        for qtype in ("Q8_0", "Q6_K", "Q4_K"):
            blocks = random_blocks(qtype, n, k, gen)
            for m in (1, 16):
                x = torch.randn(m, k, device=gt.DEV, dtype=torch.bfloat16)
                bn, warps, split = plan(m, n, qtype, blocks.shape[1] // LAYOUT[qtype][1], x.device)
                default = (bn, warps)
                tiles = [default]
                if a.sweep and not a.tiny and time.monotonic() - a.t0 < a.sweep_until_s:
                    tiles += [t for t in (SWEEP_DOT if m >= DOT_MIN_ROWS else SWEEP) if t != default]
                best = None
                for bn, warps in tiles:
                    kw = {"block_n": bn, "num_warps": warps}
                    ms = kernel_ms(lambda: gemv(x, blocks, qtype, **kw), reps, a.rounds)
                    cell = {"us": ms * 1e3, "GBps": blocks.nbytes / ms / 1e6, "block_n": bn, "warps": warps,
                            "split": split}
                    if (bn, warps) == default:
                        row[f"{qtype} GEMV m={m}"] = cell
                    total = totals.setdefault((m >= DOT_MIN_ROWS, (bn, warps)), [0.0, 0])
                    total[0], total[1] = total[0] + cell["us"], total[1] + 1
                    if best is None or cell["us"] < best["us"]:
                        best = cell
                if len(tiles) > 1:
                    row[f"{qtype} GEMV m={m} best tile"] = best
                row.update(repacked_cells(x, blocks, qtype, row[f"{qtype} GEMV m={m}"], reps, a))
    return out


def repacked_cells(x, blocks, qtype: str, old: dict, reps: int, a) -> dict:
    """The repacked GEMV on `blocks` (repacked here) at x's rows: time, GB/s, speed-up over the file-layout GEMV, its
    relative difference from that kernel's output, and at one row (Q4_K, time allowing) a sweep of its tiles."""
    from draftflow.layers import quant_gemv_repacked as rg
    from draftflow.layers.quant_gemv import gemv
    from draftflow.layers.quant_repack import repack

    m, k = x.shape
    packed = repack(blocks, qtype, k)
    plan = rg.plan(m, blocks.shape[0], qtype, k, x.device, x.dtype)
    want = gemv(x, blocks, qtype).float()
    diff = rel_diff(rg.gemv(x, packed, qtype), want)
    tiles = [(*plan[:3], plan.split, rg.PREFETCH)]
    if m == 1 and a.sweep_repacked and not a.tiny and time.monotonic() - a.t0 < a.sweep_until_s:
        sweep = [(*t[:3], t[3] or plan.split, t[4]) for t in SWEEP_REPACKED if qtype == "Q4_K" or t[4]]
        tiles += [t for t in sweep if t != tiles[0]]
    cells = {}
    for bn, units, warps, split, prefetch in tiles:
        kw = {"block_n": bn, "units": units, "num_warps": warps, "split_k": split, "prefetch": prefetch}
        ms = kernel_ms(lambda: rg.gemv(x, packed, qtype, **kw), reps, a.rounds)
        cell = {"us": ms * 1e3, "GBps": packed.nbytes / ms / 1e6, "file_GBps": blocks.nbytes / ms / 1e6,
                "speedup": old["us"] / (ms * 1e3), "block_n": bn, "units": units, "warps": warps, "split": split}
        tag = "" if (bn, units, warps, split, prefetch) == tiles[0] else \
            f" {bn}/{units}/{warps}/{split}" + (" prefetch" if prefetch else "")
        key = f"{qtype} repacked m={m}{tag}"
        cells[key] = cell
    cells[f"{qtype} repacked m={m}"]["rel_diff_vs_old"] = diff
    if m == 1:  # the activation-stationary one-row kernel (layers/quant_gemv_rows.py), which `gemv` picks at one row
        from draftflow.layers import quant_gemv_rows

        variants = [(None, None, None, None)] \
            + ([(bn, cap, None, None) for bn, cap in ROWS_SWEEP] if a.rows_sweep else []) \
            + ([(bn, None, st, None) for bn, st in STAGES_SWEEP] if a.stages_sweep else []) \
            + ([(bn, None, None, t) for bn, t in INT8_SWEEP] if a.int8_sweep else [])
        for bn, cap, st, t in variants:
            run_rows = lambda: quant_gemv_rows.gemv(x, packed, qtype, block_n=bn, maxnreg=cap, stages=st,  # noqa: E731
                                                    int8=t)
            ms = kernel_ms(run_rows, reps, a.rounds)
            tag = ("" if bn is None else f" {bn} rows/step") + (f", maxnreg {cap}" if cap else "") \
                + (f", {st} stages" if st else "") + ("" if t is None else f", int8 x{t}")
            cells[f"{qtype} rows kernel m=1{tag}"] = {"us": ms * 1e3, "GBps": packed.nbytes / ms / 1e6,
                                                      "file_GBps": blocks.nbytes / ms / 1e6,
                                                      "speedup": old["us"] / (ms * 1e3),
                                                      "rel_diff_vs_old": rel_diff(run_rows(), want)}
    if m > 1 and a.stages_sweep:
        for st in WINDOW_STAGES:
            ms = kernel_ms(lambda: rg.gemv(x, packed, qtype, stages=st), reps, a.rounds)
            cells[f"{qtype} repacked m={m}, {st} stages"] = {"us": ms * 1e3, "GBps": packed.nbytes / ms / 1e6,
                                                            "file_GBps": blocks.nbytes / ms / 1e6,
                                                            "speedup": old["us"] / (ms * 1e3),
                                                            "rel_diff_vs_old": rel_diff(rg.gemv(x, packed, qtype,
                                                                                                stages=st), want)}
    if qtype == "Q4_K" and plan.split > 1 and m <= rg.FUSED_MAX_ROWS:  # what the fused split-K reduction saves
        ms = kernel_ms(lambda: rg.gemv(x, packed, qtype, fused_reduce=False), reps, a.rounds)
        cells[f"{qtype} repacked m={m} 2 launches"] = {"us": ms * 1e3, "GBps": packed.nbytes / ms / 1e6,
                                                       "file_GBps": blocks.nbytes / ms / 1e6,
                                                       "speedup": old["us"] / (ms * 1e3)}
    return cells


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want| (want: the file-layout GEMV's product in float32)."""
    return float((got.float() - want).abs().max() / want.abs().max())


def best_repacked(projections: dict) -> tuple | None:
    """(BLOCK_N, units, warps, prefetch) of the one-row Q4_K sweep with the least time summed over the shapes, at the
    plan's split; None when that is the default or the sweep did not run on every shape."""
    from draftflow.layers import quant_gemv_repacked as rg

    totals: dict = {}
    for row in projections.values():
        for key, cell in row.items() if isinstance(row, dict) else ():
            if key.startswith("Q4_K repacked m=1") and "units" in cell:
                default = key == "Q4_K repacked m=1"
                if default or cell["split"] == row["Q4_K repacked m=1"]["split"]:
                    tile = (cell["block_n"], cell["units"], cell["warps"], "prefetch" in key or default and rg.PREFETCH)
                    totals.setdefault(tile, []).append(cell["us"])
    full = {t: sum(v) for t, v in totals.items() if len(v) == len(projections)}
    best = min(full, key=full.get) if full else None
    return None if best is None or best == (*rg.TILES["fma"], rg.PREFETCH) else best


def best_tiles(totals: dict) -> dict:
    """Per GEMV path, the tile with the least total time among those measured on every shape and type."""
    from draftflow.layers import quant_gemv as qk

    tiles = dict(qk.GEMV_TILES)
    for dot in (False, True):
        runs = {tile: v for (d, tile), v in totals.items() if d == dot and tile[0] is not None}
        full = [tile for tile, (_, n) in runs.items() if n == max(n for _, n in runs.values())]
        if full:
            tiles[dot] = min(full, key=lambda tile: runs[tile][0])
    return tiles
