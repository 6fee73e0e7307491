"""Batched decoding at Qwen3-8B / Qwen3-8B-DFlash-b16 shapes (random bf16 weights): cost per cycle at each (B, K).

    python benchmarks/gpu_batch.py --out DIR [--tiny] [--batches 1,4,16,32,64] [--ks 0,1,3,7,15]

One executor per graph on the same in-memory weights (draftflow's own path: Executor.start /
step, the one host sync per cycle included): target-only (target + verifier) and DFlash
(target with taps + dflash + verifier, num_draft 15). At each concurrency B, B requests with
128-token prompts are started and stepped together; for each K a policy node fixes the
cycle's K, 3 cycles warm up (graph capture), then `--cycles` cycles are timed.

With random weights nothing is accepted, so every cycle does the same work as a cycle of a
trained pair of the same K would (one emitted token per row here). Then, from those measured
costs: target-only tokens/s (B / cycle), and DFlash tokens/s *projected* at a published
acceptance (tau 6.5 at K = 15, Qwen3-8B-DFlash-b16 on HumanEval/GSM8K; per-position
acceptance a constant a with 1 + a + ... + a^15 = 6.5): B * E(K) / cycle(B, K), at the
fixed K = 15 and at the K the adaptive policy's rule picks (the best measured K per B).
Projections are arithmetic on measured costs and are labelled as such.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_dflash as gd  # noqa: E402
import gpu_target as gt  # noqa: E402

import bench_policy  # noqa: E402
from bench_policy import FixedK  # noqa: E402


def tau_rate(tau: float, k: int) -> float:
    """The constant per-position acceptance a with 1 + a + ... + a^k = tau."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** j for j in range(k + 1)) < tau else (lo, mid)
    return lo


def expected(a: float, k: int) -> float:
    return sum(a ** j for j in range(k + 1))


def executor(graph: dict):
    from draftflow.core.executor import Executor
    from draftflow.core.plan import build_plan
    from draftflow.core.registry import load_registry
    from draftflow.core.spec import GraphSpec

    ex = Executor(build_plan(GraphSpec.from_dict(graph), load_registry(extra_plugins=(("bench_policy", bench_policy),))))
    ex.warmup()
    return ex


def cycle_ms(ex, batch: int, k: int, cycles: int, prompt_len: int, vocab: int) -> float:
    from draftflow.core.node import SamplingParams

    FixedK.k = k
    gen = torch.Generator().manual_seed(batch)
    states = [ex.start(torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(),
                       SamplingParams(max_new_tokens=4 * cycles + 64, ignore_eos=True)) for _ in range(batch)]
    for _ in range(3):
        ex.step(states)
    gt.sync()
    t = time.perf_counter()
    for _ in range(cycles):
        ex.step(states)
    gt.sync()
    ms = (time.perf_counter() - t) / cycles * 1e3
    for s in states:
        ex.finish(s, "cancelled")
    return ms


def random_pair(tiny: bool, tokenizer=None):
    """Random bf16 Qwen3-8B and DFlash-b16 shaped models on the device (toy shapes on the CPU with `tiny`), served
    to draftflow's loaders from config-only directories: (root with target/ and drafter/, target cfg, drafter cfg).

    `tokenizer` (a tokenizers.Tokenizer) becomes the target's; the LM head rows past its vocabulary are zeroed so
    greedy output stays inside it."""
    from draftflow.layers.config import TargetConfig
    from draftflow.plugins.dflash import plugin as dflash_plugin
    from draftflow.plugins.dflash.config import DFlashConfig
    from draftflow.plugins.dflash.model import DFlashModel
    from draftflow.plugins.target import hf_loader

    tcfg_d, dcfg_d = dict(gt.QWEN3_8B), dict(gd.DRAFTER_8B)
    if tiny:
        gt.DEV = "cpu"
        vocab = tokenizer.get_vocab_size() if tokenizer is not None else gt.TINY["vocab_size"]  # its prompts' ids fit
        tcfg_d = dict(gt.TINY, num_hidden_layers=4, vocab_size=vocab)
        dcfg_d.update(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_target_layers=4,
                      dflash_config={"mask_token_id": vocab - 1, "target_layer_ids": [1, 2]})
    tcfg = TargetConfig.from_hf_dict(tcfg_d, "qwen3-8b-shape")
    dcfg = DFlashConfig.from_hf_dict(dcfg_d, "dflash-b16-shape")
    target = gt.build_model(tcfg, seed=0)
    if tokenizer is not None:
        with torch.no_grad():
            target.head_weight()[tokenizer.get_vocab_size():] = 0
    drafter = DFlashModel(dcfg, dtype=torch.bfloat16, device=gt.DEV).eval()
    gen = torch.Generator(device=gt.DEV).manual_seed(1)
    with torch.no_grad():
        for name, prm in sorted(drafter.named_parameters()):
            prm.fill_(1.0) if "norm" in name else prm.normal_(0.0, 0.02, generator=gen)
    root = Path(tempfile.mkdtemp())
    for name, d in (("target", tcfg_d), ("drafter", dcfg_d)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(d))
    hf_loader.load_hf = lambda path, device, dtype, tp=None: hf_loader.LoadedTarget(target, tcfg, tokenizer, (), "random")
    dflash_plugin.load_drafter = lambda path, device, dtype: (drafter, dcfg)
    return root, tcfg, dcfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a CPU dry run at toy shapes")
    p.add_argument("--batches", default="1,4,16,32,64")
    p.add_argument("--ks", default="0,1,3,7,15")
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--tau", type=float, default=6.5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from draftflow.core.tracing import configure_logging

    configure_logging(verbose=False)
    batches = [int(x) for x in a.batches.split(",")]
    ks = [int(x) for x in a.ks.split(",")]
    root, tcfg, dcfg = random_pair(a.tiny)
    common = {"device": gt.DEV, "dtype": "bfloat16", "max_context": 1024,
              "max_batch": max(batches)}
    plain = executor({**common, "num_draft": 0, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(root / "target")}}, "verify": {"plugin": "verifier"}}})
    spec = executor({**common, "num_draft": max(ks), "nodes": {
        "target": {"plugin": "target", "params": {"path": str(root / "target"), "tap_layers": list(dcfg.target_layer_ids)}},
        "drafter": {"plugin": "dflash", "params": {"path": str(root / "drafter")}},
        "policy": {"plugin": "bench-k"}, "verify": {"plugin": "verifier"}}})
    res = {"device": torch.cuda.get_device_name() if gt.DEV == "cuda" else "cpu", "torch": torch.__version__,
           "tau": a.tau, "cycle_ms": {}, "target_only_ms": {}}
    for b in batches:
        res["target_only_ms"][b] = cycle_ms(plain, b, 0, a.cycles, 128, tcfg.vocab_size)
        res["cycle_ms"][b] = {k: cycle_ms(spec, b, k, a.cycles, 128, tcfg.vocab_size) for k in ks}
        print(f"B={b}: target-only {res['target_only_ms'][b]:.2f} ms, dflash {res['cycle_ms'][b]}", flush=True)
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            (Path(a.out) / "batch.json").write_text(json.dumps(res, indent=1))
    report(res, ks)


def report(res: dict, ks: list[int]) -> None:
    rate = tau_rate(res["tau"], max(ks))
    one = 1 / res["target_only_ms"][min(res["target_only_ms"])] * 1e3
    print(f"\n{res['device']}, torch {res['torch']}; projected at tau {res['tau']} (K={max(ks)}; a={rate:.3f} per position)")
    print("| B | target-only ms/step | tok/s | x B=1 | " + " | ".join(f"DFlash K={k} ms" for k in ks)
          + f" | K={max(ks)} proj tok/s | x | adaptive K | proj tok/s | x |")
    print("|---" * (10 + len(ks)) + "|")
    for b, t_ms in res["target_only_ms"].items():
        b = int(b)
        plain = b / t_ms * 1e3
        costs = {int(k): v for k, v in res["cycle_ms"][str(b) if str(b) in res["cycle_ms"] else b].items()}
        proj = {k: b * expected(rate, k) / ms * 1e3 for k, ms in costs.items()}
        best = max(proj, key=proj.get)
        fixed = proj[max(ks)]
        choice, best_rate = best, proj[best]  # K = 0 here is the DFlash graph not drafting (its cost measured)
        print(f"| {b} | {t_ms:.2f} | {plain:.0f} | {plain / one:.1f} | " + " | ".join(f"{costs[k]:.2f}" for k in ks)
              + f" | {fixed:.0f} | {fixed / plain:.2f} | {choice} | {best_rate:.0f} | {best_rate / plain:.2f} |")


if __name__ == "__main__":
    main()
