"""One-row GEMV: cuBLAS (F.linear) against draftflow's Triton GEMV (layers/gemv.py), per projection shape.

    python benchmarks/gpu_gemv.py [--out F.json] [--tiny]

For each [N, K] weight of the Qwen3-30B-A3B layer (q/k/v fused, o_proj, router) and of Qwen3-8B
(q/k/v, o_proj, gate/up, down), bf16: the time of one product, captured 10 to a CUDA graph and
replayed, over enough distinct weight copies (>= 160 MB) that no product reads its weight from the
50 MB L2, and its bandwidth against the copy bandwidth measured in the same run; with the Triton
kernel's largest difference from cuBLAS (relative to the output's largest value). `--tiny` runs
small shapes on the CPU through Triton's interpreter (a smoke run; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import gpu_target as gt  # noqa: E402  (copy bandwidth, CUDA-event timer)

SHAPES = {"30B-A3B q/k/v": (5120, 2048), "30B-A3B o_proj": (2048, 4096), "30B-A3B router": (128, 2048),
          "8B q/k/v": (6144, 4096), "8B o_proj": (4096, 4096), "8B gate/up": (24576, 4096), "8B down": (4096, 12288)}
TINY = {"tiny q/k/v": (96, 64), "tiny o_proj": (64, 1536)}
SWEEP = ((8, 512, 4), (8, 512, 8), (16, 256, 4), (4, 1024, 4), (16, 512, 4), (8, 256, 8))  # BLOCK_N, BLOCK_K, per SM


def timed(fn_for, copies: int, reps: int, rounds: int, calls: int = 10) -> float:
    """ms of one call: `calls` calls over rotating weight copies captured in one CUDA graph, replayed."""
    if gt.DEV == "cpu":
        return gt.cuda_ms(lambda: fn_for(0), reps=reps, rounds=rounds)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in range(copies):
            fn_for(c)  # compiled and warm before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn_for(i % copies)
    return gt.cuda_ms(graph.replay, reps=reps, rounds=rounds) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU through Triton's interpreter")
    p.add_argument("--sweep", action="store_true", help="also time the Triton kernel at each tile of SWEEP")
    p.add_argument("--out", default=None, help="results JSON file")
    a = p.parse_args()
    from draftflow.layers import gemv

    gt.DEV = dev = "cpu" if a.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    reps, rounds = (1, 1) if dev == "cpu" else (50, 5)
    bw = gt.copy_bandwidth() if dev == "cuda" else float("nan")
    rows = []
    for name, (n, k) in (TINY if dev == "cpu" else SHAPES).items():
        nbytes = n * k * dtype.itemsize
        copies = 1 if dev == "cpu" else max(2, math.ceil(160e6 / nbytes))
        weights = [torch.randn(n, k, device=dev).mul_(k ** -0.5).to(dtype) for _ in range(copies)]
        x = torch.randn(1, k, device=dev).to(dtype)
        with torch.inference_mode():
            want = torch.nn.functional.linear(x, weights[0]).float()
            err = ((gemv.linear(x, weights[0]).float() - want).abs().max() / want.abs().max()).item()
            cublas = timed(lambda c: torch.nn.functional.linear(x, weights[c]), copies, reps, rounds)
            triton_ms = timed(lambda c: gemv.linear(x, weights[c]), copies, reps, rounds)
            sweep = {}
            default = (gemv.BLOCK_N, gemv.BLOCK_K, gemv.PROGRAMS_PER_SM)
            for tile in SWEEP if a.sweep else ():
                gemv.BLOCK_N, gemv.BLOCK_K, gemv.PROGRAMS_PER_SM = tile
                try:
                    sweep[str(tile)] = timed(lambda c: gemv.linear(x, weights[c]), copies, reps, rounds) * 1e3
                finally:
                    gemv.BLOCK_N, gemv.BLOCK_K, gemv.PROGRAMS_PER_SM = default
        chunk, split = gemv.split_of(n, k, x.device)
        rows.append({"projection": name, "n": n, "k": k, "MB": nbytes / 1e6, "split": split, "cublas_us": cublas * 1e3,
                     "triton_us": triton_ms * 1e3, "cublas_TBps": nbytes / (cublas * 1e-3) / 1e12,
                     "triton_TBps": nbytes / (triton_ms * 1e-3) / 1e12, "max_rel_diff": err, "sweep_us": sweep})
        del weights
    device = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter smoke run)"
    print(f"one-row GEMV, {dtype}, {device}, copy bandwidth {bw:.2f} TB/s")
    print(f"{'projection':18}{'N x K':>14}{'MB':>7}{'split':>6}{'cuBLAS us':>11}{'TB/s':>6}{'Triton us':>11}{'TB/s':>6}"
          f"{'Triton/cuBLAS':>15}{'max diff':>10}")
    for r in rows:
        print(f"{r['projection']:18}{r['n']:>7} x{r['k']:>6}{r['MB']:>7.1f}{r['split']:>6}{r['cublas_us']:>11.2f}"
              f"{r['cublas_TBps']:>6.2f}{r['triton_us']:>11.2f}{r['triton_TBps']:>6.2f}"
              f"{r['cublas_us'] / r['triton_us']:>14.2f}x{r['max_rel_diff']:>10.1e}")
        if r["sweep_us"]:
            print("    sweep (BLOCK_N, BLOCK_K, programs/SM): " + ", ".join(f"{t} {us:.2f}" for t, us in r["sweep_us"].items()))
    if a.out:
        Path(a.out).write_text(json.dumps({"device": device, "torch": torch.__version__, "copy_TBps": bw, "rows": rows},
                                          indent=1))


if __name__ == "__main__":
    main()
