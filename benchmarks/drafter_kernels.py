"""Launches and time of one DFlash / DFlash2 proposal, with the block path's Triton kernels on and off.

    python benchmarks/drafter_kernels.py [--device cuda] [--dtype bfloat16] [--graphs demo-dflash.yaml ...]

For each shipped graph and each setting of the drafter node's `triton` param (CUDA: on and off;
CPU: off, the only path there): one request of the README prompt (which captures what it needs),
then the proposal alone, as a cycle runs it (4 new context rows, the full block, the LM head),
`--calls` times: its wall time per proposal (CUDA: events around back-to-back replays), and under
torch.profiler the kernels per proposal (CUDA) or the aten ops per proposal (CPU). The table and
`--out`/results.json hold the numbers (docs/BENCHMARKS.md, docs/DFLASH.md "The block path on CUDA").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from draftflow.core.node import SamplingParams
from draftflow.core.session import Session

GRAPHS = Path(__file__).resolve().parent.parent / "graphs"
PROMPT = "def fibonacci(n):"
START = 40  # context length before each timed proposal


def measure(graph: Path, device: str, dtype: str, triton: bool, calls: int) -> dict:
    """One graph's drafter node: per-proposal microseconds and launches (kernels on CUDA, aten ops on the CPU)."""
    overrides = [f"device={device}", f"dtype={dtype}", f"nodes.drafter.params.triton={str(triton).lower()}"]
    session = Session.open(graph_path=graph, overrides=overrides)
    try:
        node = session.executor.nodes["drafter"]
        session.generate(session.encode(PROMPT), SamplingParams(max_new_tokens=64))  # fills the context past START
        cfg, runner = node.config, node._runner()
        rows = torch.zeros(1, 4, cfg.num_taps * cfg.hidden_size, dtype=node.dtype, device=device)
        block = torch.full((1, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=device)

        def propose():
            node.caches[0].crop(START)
            if runner is not None:
                return runner(rows, START, 5, runner.width)
            return node._eager_block(rows, START, 5, block.shape[1], block.shape[1] - 1, node.caches[0])

        with torch.inference_mode():
            for _ in range(10):
                propose()
            us = _time(propose, calls, device)
            cuda = device.startswith("cuda")
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(10):
                    propose()
                if cuda:
                    torch.cuda.synchronize()
        if cuda:
            launches = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events()) / 10
        else:
            launches = sum(e.cpu_parent is None and e.name.startswith("aten::") for e in prof.events()) / 10
        return {"graph": graph.name, "triton": triton, "us_per_proposal": round(us, 1), "launches": launches,
                "unit": "kernels" if cuda else "aten ops", "path": "graph replay" if runner is not None else "eager"}
    finally:
        session.close()


def _time(fn, calls: int, device: str) -> float:
    """Median over 5 rounds of the mean microseconds per call."""
    rounds = []
    for _ in range(5):
        if device.startswith("cuda"):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            rounds.append(begin.elapsed_time(end) * 1e3 / calls)
        else:
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            rounds.append((time.perf_counter() - t) * 1e6 / calls)
    return sorted(rounds)[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--graphs", nargs="+", default=["demo-dflash.yaml", "demo-dflash2.yaml"],
                   help="graph files (a bare name is one of graphs/) whose `drafter` node is a dflash or dflash2 node")
    p.add_argument("--calls", type=int, default=50, help="proposals per timing round")
    p.add_argument("--out", help="folder for results.json")
    a = p.parse_args(argv)
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    settings = (True, False) if a.device.startswith("cuda") else (False,)
    rows = []
    for name in a.graphs:
        graph = Path(name) if Path(name).exists() else GRAPHS / name
        for triton in settings:
            rows.append(measure(graph, a.device, dtype, triton, a.calls))
    print(f"{'graph':<22}{'triton':>8}{'path':>14}{'us/proposal':>13}{'launches':>10}  unit")
    for r in rows:
        print(f"{r['graph']:<22}{str(r['triton']).lower():>8}{r['path']:>14}{r['us_per_proposal']:>13.1f}"
              f"{r['launches']:>10.1f}  {r['unit']}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "results.json").write_text(json.dumps({"device": a.device, "dtype": dtype, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
