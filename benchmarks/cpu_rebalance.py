"""Host time of `ExpertCache.rebalance` (between windows on the device path) at a MoE shape, on the CPU.

The device path's promotions are decided on the host between windows, on the critical path of a
cycle. This times one `rebalance` with random routing counts folded in every time, so every layer
has misses and (with the default policy) promotes one expert per window:

    python benchmarks/cpu_rebalance.py                    # Qwen3-Next-80B-A3B: 48 layers x 512 experts, top-10
    python benchmarks/cpu_rebalance.py --experts 128 --top-k 8   # Qwen3-30B-A3B
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=512)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--resident", type=float, default=0.84, help="fraction of the experts resident")
    p.add_argument("--window", type=int, default=16, help="tokens routed per window")
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    from draftflow.layers.expert_cache import ExpertCache
    from draftflow.layers.moe import HostExperts

    n, e = a.layers, a.experts
    host = HostExperts(tuple(range(n)), torch.zeros(n, e, 16, 16), torch.zeros(n, e, 16, 8))  # tiny experts
    cache = ExpertCache(host, int(n * e * a.resident), a.top_k, "cpu")
    cache.device_path = True  # the CUDA path's bookkeeping; rebalance is host code either way
    gen, times = torch.Generator().manual_seed(0), []
    for _ in range(a.reps):
        ids = torch.randint(0, e, (n, a.window * a.top_k), generator=gen)
        cache.staged[:, :e] += torch.zeros(n, e, dtype=torch.int32).scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
        t = time.perf_counter()
        cache.rebalance()
        times.append((time.perf_counter() - t) * 1e3)
    print(f"rebalance, {n} layers x {e} experts, top-{a.top_k}, {a.resident:.0%} resident, {a.window}-token windows, "
          f"{torch.get_num_threads()} threads: median {statistics.median(times):.2f} ms "
          f"(min {min(times):.2f}); {cache.upload_bytes // cache.bytes_per_expert / a.reps:.1f} promotions a window")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
