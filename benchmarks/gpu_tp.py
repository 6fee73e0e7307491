"""Tensor parallelism on one host: tokens/s at TP=1 vs TP=2, a 70B shape at TP=2 against its floor, all-reduce cost.

    python benchmarks/gpu_tp.py --out DIR           # 2 GPUs: every phase, DIR/<phase>.json, then the table
    python benchmarks/gpu_tp.py --report DIR        # the table again
    python benchmarks/gpu_tp.py --tiny --out DIR    # a CPU dry run of this script (gloo, toy shapes)

Phases (each its own processes, rank 0 measures; docs/TENSOR_PARALLEL.md):
- qwen3-8b-tp1, qwen3-8b-tp2: a Qwen3-8B-shaped target, target-only greedy decoding at batch 1
  through a real draftflow graph (CUDA graphs on); the goal is >= 1.6x at TP=2.
- llama-70b-tp2, llama-70b-dflash-tp2: a Llama-3-70B shape (80 layers, hidden 8192, 64/8 heads;
  140 GB in bf16, more than one H200 holds), target-only and with a DFlash drafter of its width.
  Goal: >= 60% of the per-rank weight-read floor (the bytes one rank reads per step: its layer
  shards and its vocabulary slice of the head, over the measured copy bandwidth).
- every TP=2 phase: one all-reduce of a decode step's hidden state and the logits all-gather,
  timed alone, times the 2 per layer and 1 per step a forward issues.

Weights are random, drawn on each rank's GPU (no checkpoint: 140 GB does not fit that machine's
disk); the loaders are replaced by the draw, the rest is the shipped code path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_target as gt  # noqa: E402  (timers, copy bandwidth)

LLAMA_70B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=8192,
                 intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                 head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                 tie_word_embeddings=False, attention_bias=False, hidden_act="silu")
DRAFTER_70B = {**LLAMA_70B, "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_hidden_layers": 5,
               "block_size": 16, "num_target_layers": 80,
               "dflash_config": {"mask_token_id": 128002, "target_layer_ids": [1, 20, 39, 58, 77]}}
TINY_DRAFTER = {**DRAFTER_70B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_target_layers": 4,
                "dflash_config": {"mask_token_id": 511, "target_layer_ids": [1, 2]}}
PHASES = {  # name: (target shape, ranks, drafter shape or None)
    "qwen3-8b-tp1": ("qwen3-8b", 1, None), "qwen3-8b-tp2": ("qwen3-8b", 2, None),
    "llama-70b-tp2": ("llama-70b", 2, None), "llama-70b-dflash-tp2": ("llama-70b", 2, "dflash-70b"),
}
TIMEOUT_S = 1800


def shapes(tiny: bool) -> dict:
    if tiny:
        small = dict(gt.TINY, num_hidden_layers=4)
        return {"qwen3-8b": small, "llama-70b": {**small, "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
                "dflash-70b": TINY_DRAFTER}
    return {"qwen3-8b": gt.QWEN3_8B, "llama-70b": LLAMA_70B, "dflash-70b": DRAFTER_70B}


def draw(module: torch.nn.Module, seed: int) -> None:
    """N(0, 0.02) weights and unit norms, in place, drawn on the module's device in a fixed order."""
    gen = torch.Generator(device=gt.DEV).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=gen)


def worker(phase: str, tiny: bool, out: Path, new: int, repeats: int) -> None:
    """One rank of a phase: open the graph on random weights, decode, then time the collectives alone."""
    from draftflow.core.errors import FollowerDone
    from draftflow.core.node import SamplingParams
    from draftflow.core.session import Session
    from draftflow.core.tracing import configure_logging
    from draftflow.layers.config import TargetConfig
    from draftflow.layers.tensor_parallel import SINGLE
    from draftflow.plugins.target import hf_loader
    from draftflow.plugins.target.model import TargetModel

    configure_logging(verbose=False)
    target_shape, ranks, drafter_shape = PHASES[phase]
    shape = shapes(tiny)[target_shape]
    tcfg = TargetConfig.from_hf_dict(shape, target_shape)
    rank = int(os.environ.get("RANK", 0))
    built = {}

    def load(path, device, dtype, tp=SINGLE):
        model = TargetModel(tcfg, dtype=dtype, device=device, tp=tp).eval()
        draw(model, seed=rank)
        built["target"] = model
        return hf_loader.LoadedTarget(model, tcfg, None, (), "random")

    hf_loader.load_hf = load
    root = Path(tempfile.mkdtemp())
    (root / "target").mkdir()
    (root / "target" / "config.json").write_text(json.dumps(shape))
    nodes = {"target": {"plugin": "target", "params": {"path": str(root / "target")}}, "verify": {"plugin": "verifier"}}
    graph = {"device": gt.DEV, "dtype": "bfloat16", "max_context": 1024, "tensor_parallel": ranks, "nodes": nodes}
    if drafter_shape is not None:
        from draftflow.plugins.dflash import plugin as dflash_plugin
        from draftflow.plugins.dflash.config import DFlashConfig
        from draftflow.plugins.dflash.model import DFlashModel

        dshape = shapes(tiny)[drafter_shape]
        dcfg = DFlashConfig.from_hf_dict(dshape, drafter_shape)

        def load_drafter(path, device, dtype):
            drafter = DFlashModel(dcfg, dtype=dtype, device=device).eval()
            draw(drafter, seed=100)  # replicated: the same weights on every rank
            built["drafter"] = drafter
            return drafter, dcfg

        dflash_plugin.load_drafter = load_drafter
        (root / "drafter").mkdir()
        (root / "drafter" / "config.json").write_text(json.dumps(dshape))
        nodes["target"]["params"]["tap_layers"] = list(dcfg.target_layer_ids)
        nodes["drafter"] = {"plugin": "dflash", "params": {"path": str(root / "drafter")}}
        graph["num_draft"] = dcfg.block_size - 1
    res = {"phase": phase, "ranks": ranks, "device": torch.cuda.get_device_name() if gt.DEV == "cuda" else "cpu"}
    try:
        t = time.perf_counter()
        session = Session.open(graph_dict=graph)
        res["open_s"] = time.perf_counter() - t
        prompt = torch.randint(0, tcfg.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
        run = gt.run_session(session, prompt, new, repeats)
        run.pop("tokens")
        last = session.generate(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
        res.update(run, cycles=last.stats["cycles"], tau=last.stats["tau"])
        session.close()
    except FollowerDone:
        pass
    if ranks > 1:
        res["collectives"] = collectives(tcfg, ranks)
    if rank == 0:
        res["copy_tb_s"] = bw = gt.copy_bandwidth()
        res.update(floors(built, tcfg, ranks, bw * 1e12))
        (out / f"{phase}.json").write_text(json.dumps(res, indent=1))


def floors(built: dict, tcfg, ranks: int, bw: float) -> dict:
    """Bytes one rank reads per decode step (its layer shards and its head slice; not the embedding), over bandwidth."""
    model = built["target"]
    layers = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                 if "embed_tokens" not in n and "lm_head" not in n)
    head = model.head_weight()
    target = layers + head.numel() * head.element_size() // ranks
    out = {"rank_weight_bytes": target, "target_floor_ms": target / bw * 1e3}
    if "drafter" in built:  # a replicated drafter reads all of itself and the whole head for its drafts
        drafter = sum(p.numel() * p.element_size() for p in built["drafter"].parameters())
        out["cycle_floor_ms"] = (target + drafter + head.numel() * head.element_size()) / bw * 1e3
    return out


def collectives(tcfg, ranks: int, reps: int = 200) -> dict:
    """Time one decode step's collectives alone: the hidden-state all-reduce (2 per layer), the logits all-gather."""
    from draftflow.layers.tensor_parallel import group

    tp = group(ranks, gt.DEV)
    hidden = torch.randn(1, 1, tcfg.hidden_size, dtype=torch.bfloat16, device=gt.DEV)
    logits = torch.randn(1, 1, -(-tcfg.vocab_size // ranks), dtype=torch.float32, device=gt.DEV)
    for _ in range(10):
        tp.all_reduce(hidden)
        tp.gather_vocab(logits, tcfg.vocab_size)
    reduce_ms = gt.cuda_ms(lambda: tp.all_reduce(hidden), reps)
    gather_ms = gt.cuda_ms(lambda: tp.gather_vocab(logits, tcfg.vocab_size), reps)
    return {"all_reduce_us": reduce_ms * 1e3, "gather_us": gather_ms * 1e3,
            "per_step_ms": 2 * tcfg.num_layers * reduce_ms + gather_ms}


def launch(phase: str, a) -> int:
    """Run one phase as its ranks (torchrun's environment, a free port); returns rank 0's exit code."""
    from draftflow.core.tp_launch import free_port

    ranks = PHASES[phase][1]
    port = str(free_port())
    cmd = [sys.executable, __file__, "--worker", phase, "--out", a.out, "--new", str(a.new), "--repeats", str(a.repeats)]
    cmd += ["--tiny"] if a.tiny else []
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen(cmd, env=env))
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return codes[0] or max(codes)


def report(out: Path) -> None:
    res = {p: json.loads((out / f"{p}.json").read_text()) for p in PHASES if (out / f"{p}.json").exists()}
    if not res:
        print(f"no results in {out}")
        return
    first = next(iter(res.values()))
    print(f"tensor parallelism, {first['device']}, bf16 random weights, batch 1, greedy")
    print(f"{'phase':<22} {'tok/s':>8} {'ms/step':>8} {'floor ms':>8} {'of floor':>8} {'AR us':>7} {'AR ms/step':>10}")
    for name, r in res.items():
        tok_s = r.get("tok_s_decode")
        step = 1e3 / tok_s * (r.get("tau") or 1) if tok_s else None  # a cycle for a drafted phase
        floor = r.get("cycle_floor_ms", r.get("target_floor_ms"))
        coll = r.get("collectives", {})
        cells = [f"{tok_s:8.1f}" if tok_s else f"{'-':>8}", f"{step:8.3f}" if step else f"{'-':>8}", f"{floor:8.3f}",
                 f"{floor / step:8.0%}" if step else f"{'-':>8}", f"{coll.get('all_reduce_us', 0):7.1f}",
                 f"{coll.get('per_step_ms', 0):10.3f}"]
        print(f"{name:<22} " + " ".join(cells))
    if "qwen3-8b-tp1" in res and "qwen3-8b-tp2" in res and res["qwen3-8b-tp1"].get("tok_s_decode"):
        speed = res["qwen3-8b-tp2"]["tok_s_decode"] / res["qwen3-8b-tp1"]["tok_s_decode"]
        print(f"Qwen3-8B shape, TP=2 over TP=1: {speed:.2f}x (goal >= 1.6x; gpt-fast: 1.59x for Llama-3.1-8B on A100s)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/gpu_tp")
    p.add_argument("--report", metavar="DIR", help="print the table of an earlier run")
    p.add_argument("--tiny", action="store_true", help="CPU dry run at toy shapes (gloo)")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of: " + ", ".join(PHASES))
    p.add_argument("--new", type=int, default=128, help="tokens per request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.tiny:
        gt.DEV = "cpu"
    if a.report:
        report(Path(a.report))
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.worker:
        worker(a.worker, a.tiny, out, a.new, a.repeats)
        return 0
    for phase in a.phases.split(","):
        code = launch(phase, a)
        print(f"[{time.strftime('%X')}] {phase}: exit {code}", flush=True)
    report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
