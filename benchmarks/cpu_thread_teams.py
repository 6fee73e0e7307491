"""Why `draftflow serve` opens the graph on its worker thread: a CPU request on the thread that loaded the model,
on another thread beside it, and on a thread that loaded it itself.

    python benchmarks/cpu_thread_teams.py [--graph graphs/demo.yaml] [--requests 5]

Each case runs in a fresh process: the README prompt, 64 new tokens, ``--requests`` times, wall ms each.
Each thread that runs torch's parallel regions gets its own OpenMP team; with two teams on the cores
(the opener's and the decoder's) libgomp stops spinning between regions.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "main": "open and decode on the main thread (generate)",
    "beside": "open on the main thread, decode on a second one (serve before)",
    "worker": "open and decode on a second thread (serve now)",
}


def child(case: str, graph: str, requests: int) -> None:
    from draftflow.core.node import SamplingParams
    from draftflow.core.session import Session

    box = {}

    def open_():
        box["session"] = Session.open(graph_path=Path(graph))

    def decode():
        s = box["session"]
        ids, sampling = s.encode("def fibonacci(n):"), SamplingParams(max_new_tokens=64)
        times = []
        for _ in range(requests):
            began = time.perf_counter()
            s.generate(ids, sampling)
            times.append(round((time.perf_counter() - began) * 1e3, 1))
        box["ms"] = times

    def on_thread(fn):
        t = threading.Thread(target=fn)
        t.start()
        t.join()

    if case == "worker":
        on_thread(lambda: (open_(), decode()))
    else:
        open_()
        (decode if case == "main" else lambda: on_thread(decode))()
    print(json.dumps(box["ms"]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", default=str(ROOT / "graphs" / "demo.yaml"))
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.graph, a.requests)
        return 0
    print(f"{'case':8} {'ms a request':>40}  what")
    for case, what in CASES.items():
        out = subprocess.run([sys.executable, __file__, "--child", case, "--graph", a.graph, "--requests",
                              str(a.requests)], capture_output=True, text=True, check=True).stdout
        ms = json.loads(out.strip().splitlines()[-1])
        print(f"{case:8} {' '.join(f'{m:.0f}' for m in ms):>40}  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
