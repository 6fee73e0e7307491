"""Acceptance against context length: does a drafter keep drafting past the windows it was trained on?

    python benchmarks/context_tau.py [--graph graphs/demo-dflash.yaml] [--lengths 100 200 ...] [--set K=V ...]

One session of the graph; for each length N, a greedy request of `--tokens` new tokens after the first N tokens
of `json/encoder.py` + `json/decoder.py` (this Python's standard library: text a code drafter may have seen, so a
fall in tau with N is the drafter's reach, not unfamiliar text). Prints tau and acceptance per N
(graphs/models/demo/MODEL_CARD.md, "Attention window").
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

from draftflow.core.node import SamplingParams
from draftflow.core.session import Session

GRAPHS = Path(__file__).resolve().parent.parent / "graphs"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graph", default=str(GRAPHS / "demo-dflash.yaml"))
    p.add_argument("--lengths", type=int, nargs="+", default=[100, 200, 300, 400, 500, 520, 600, 800])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    session = Session.open(graph_path=a.graph, overrides=a.overrides)
    text = inspect.getsource(json.encoder) + inspect.getsource(json.decoder)
    ids = session.encode(text)
    print("| context tokens | tau | acceptance |\n|---:|---:|---:|")
    for n in a.lengths:
        stats = session.generate(ids[:n], SamplingParams(max_new_tokens=a.tokens, ignore_eos=True)).stats
        print(f"| {n} | {stats['tau']:.2f} | {stats['acceptance_rate']:.3f} |")


if __name__ == "__main__":
    main()
