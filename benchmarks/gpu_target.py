"""Target decode on one GPU at Qwen3-8B shapes (random bf16 weights): floor, our speed, transformers, verify curve, profile.

    python benchmarks/gpu_target.py --out DIR            # run everything, save DIR/results.json, print the tables
    python benchmarks/gpu_target.py --report DIR/results.json   # print the tables again
    python benchmarks/gpu_target.py --quick --out DIR    # open + warm-up cost, first request, steady decode only

The weights are drawn on the GPU (no checkpoint is written). The floor is the bytes one
decode step must read (every weight but the embedding table) over the device-to-device
copy bandwidth measured in the same run. transformers runs on the *same tensors*
(its parameters are assigned ours). Results are saved after every phase, so a phase
that fails or runs out of time leaves the earlier numbers in results.json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
import traceback
from pathlib import Path

from gpu_target_report import report

import torch

QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
                intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                tie_word_embeddings=False, attention_bias=False, hidden_act="silu")
TINY = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # --tiny: a CPU dry run of this script
DEV = "cuda"
KERNEL_CLASSES = (  # first match wins: attention kernels are CUTLASS too
    ("attention", r"fmha|attention|flash|_attn_"),
    ("q/k-norm + RoPE + KV write (Triton)", r"_qk_rope_write"),
    ("GEMM/GEMV (cuBLAS)", r"gemm|gemv|cutlass|xmma|nvjet|splitk|cublas"),
    ("fused elementwise (inductor)", r"^triton_"),
    ("KV write (index_copy)", r"index_copy|indexCopy|indexFuncLargeIndex"),
    ("other kernels", r"."),
)


class Results(dict):
    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def save(self, key: str, value) -> None:
        self[key] = value
        self.path.write_text(json.dumps(self, indent=1))
        print(f"[{time.strftime('%X')}] {key}: {json.dumps(value)[:400]}", flush=True)


def cuda_ms(fn, reps: int, rounds: int = 5) -> float:
    """Median over `rounds` of the mean time of `reps` back-to-back calls, by CUDA events."""
    times = []
    for _ in range(rounds):
        if DEV == "cpu":
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t) * 1e3 / reps)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (TB/s), on 2 GiB of random data."""
    src = torch.randn(1 << (30 if DEV == "cuda" else 22), dtype=torch.bfloat16, device=DEV)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = cuda_ms(lambda: dst.copy_(src), reps=10)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12


def build_model(cfg, seed: int):
    """A TargetModel with N(0, 0.02) weights and unit norms, drawn on the GPU in a fixed order."""
    from draftflow.plugins.target.model import TargetModel

    model = TargetModel(cfg, dtype=torch.bfloat16, device=DEV).eval()
    gen = torch.Generator(device=DEV).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.inv_freq = model.inv_freq.to(DEV)
    return model


def checksum(model) -> float:
    return float(sum(p.float().sum() for p in model.parameters()))


def time_runner(runner, start: int, w: int, reps: int = 50) -> float:
    drafts = torch.randint(0, 100, (1, w - 1), device=DEV) if w > 1 else None
    with torch.inference_mode():
        runner(7, drafts, start)  # capture
        sync()
        return cuda_ms(lambda: runner(7, drafts, start), reps)


def long_context(model, cfg, runner_cls) -> dict:
    """Graph replay time against context length, SDPA (memory-efficient kernel) vs the split-KV Triton attention."""
    from draftflow.layers.kv_cache import KVCache, static_shape

    kv = KVCache.from_static(torch.randn(static_shape(cfg, 1, 4096), dtype=torch.bfloat16, device=DEV))
    kv.commit(4000)
    out = {}
    for name, split in (("sdpa", False), ("split", True)):
        runner = runner_cls(model, kv, 16, triton_attention=split and DEV == "cuda", capture=DEV == "cuda")
        for start, w in ((160, 1), (1000, 1), (3000, 1), (3000, 16)):
            out[f"{name} pos {start} W={w}"] = time_runner(runner, start, w, reps=20)
    return out


def sync_loop(runner, kv, start: int, n: int) -> dict:
    """Greedy decoding straight on the runner: what a cycle costs with one host sync but no executor."""
    def decode():
        tok = 7
        for pos in range(start, start + n):
            logits, _ = runner(tok, None, pos)
            tok = int(logits[0, -1].argmax())
            kv.commit(pos + 1)
        kv.crop(start)

    with torch.inference_mode():
        decode()  # captures the buckets it crosses
        sync()
        t = time.perf_counter()
        decode()
        sync()
    return {"w1_ms": (time.perf_counter() - t) / n * 1e3}


def open_session(model, cfg, cfg_dir: Path, cuda_graphs: bool, max_context: int):
    """A real draftflow graph (target + verifier) whose target node gets the in-memory model."""
    from draftflow.core.session import Session
    from draftflow.plugins.target import hf_loader

    hf_loader.load_hf = lambda path, device, dtype, tp=None: hf_loader.LoadedTarget(model, cfg, None, (), "random")
    graph = {"device": DEV, "dtype": "bfloat16", "max_context": max_context, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(cfg_dir), "cuda_graphs": cuda_graphs}},
        "verify": {"plugin": "verifier"}}}
    return Session.open(graph_dict=graph)


def run_session(session, prompt, new: int, repeats: int) -> dict:
    from draftflow.core.node import SamplingParams

    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    session.generate(prompt, sp)  # warm-up: captures every graph this length needs
    e2e, decode, tokens = [], [], None
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        out = session.generate(prompt, sp)
        sync()
        total = time.perf_counter() - t
        e2e.append(len(out.token_ids) / total)
        decode.append((len(out.token_ids) - 1) / (total - out.stats["ttft_s"]))
        tokens = list(out.token_ids)
    return {"tok_s_e2e": statistics.median(e2e), "tok_s_decode": statistics.median(decode), "tokens": tokens}


def cold_start(model, cfg, shapes, a) -> dict:
    """The target node as a user gets it: open (warm-up included), the first request, then steady decoding."""
    from draftflow.core.node import SamplingParams

    cfg_dir = Path(tempfile.mkdtemp())
    (cfg_dir / "config.json").write_text(json.dumps(shapes))
    prompt = torch.randint(0, cfg.vocab_size, (a.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    t = time.perf_counter()
    session = open_session(model, cfg, cfg_dir, True, max_context=4096)
    out = {"open_s": time.perf_counter() - t, "warmup_s": getattr(session.executor, "warmup_s", None)}
    runner = session.executor.nodes["target"].runner
    captures = getattr(runner, "capture_s", {})
    out["graphs_at_warmup"] = len(runner.graphs) if runner is not None else 0
    out["capture_s"] = {f"W={w} bucket={b}": s for (_, w, b), s in captures.items()}  # batch bucket 1 at warm-up
    sync()
    t = time.perf_counter()
    first = session.generate(prompt, SamplingParams(max_new_tokens=a.new, ignore_eos=True))
    sync()
    total = time.perf_counter() - t
    out["first_request"] = {"wall_s": total, "ttft_s": first.stats["ttft_s"], "tok_s_e2e": len(first.token_ids) / total,
                            "tok_s_decode": (len(first.token_ids) - 1) / (total - first.stats["ttft_s"]),
                            "graphs_captured_inside": len(runner.graphs) - out["graphs_at_warmup"] if runner else None}
    out["steady"] = run_session(session, prompt, a.new, a.repeats)
    out["steady"].pop("tokens")
    return out


def teacher_forced(model, cfg, runner_cls, seq: list[int], prompt_len: int, steps: int) -> dict:
    """Feed the same tokens one at a time to the eager forward and to captured graphs; compare logits."""
    from draftflow.layers.kv_cache import KVCache, static_shape

    caches = [KVCache.from_static(torch.zeros(static_shape(cfg, 1, 512), dtype=torch.bfloat16, device=DEV))
              for _ in range(2)]
    ctx = torch.tensor([seq[:prompt_len - 1]], device=DEV)
    diffs, agree, gaps = [], [], []
    with torch.inference_mode():
        for c in caches:
            model(ctx, 0, c)
            c.commit(prompt_len - 1)
        runner = runner_cls(model, caches[1], 1, capture=DEV == "cuda")
        for pos in range(prompt_len - 1, prompt_len - 1 + steps):
            eager, _ = model(torch.tensor([[seq[pos]]], device=DEV), pos, caches[0])
            graph, _ = runner(seq[pos], None, pos)
            for c in caches:
                c.commit(pos + 1)
            top2 = eager[0, 0].topk(2).values
            diffs.append((eager - graph).abs().max())
            agree.append(eager[0, 0].argmax() == graph[0, 0].argmax())
            gaps.append(top2[0] - top2[1])
    diffs, agree, gaps = torch.stack(diffs).tolist(), torch.stack(agree).tolist(), torch.stack(gaps).tolist()
    flips = [i for i, ok in enumerate(agree) if not ok]
    return {"steps": steps, "argmax_agree": sum(agree), "max_abs_logit_diff": max(diffs),
            "median_abs_logit_diff": statistics.median(diffs), "flip_steps": flips,
            "top2_gap_at_flips": [gaps[i] for i in flips], "min_top2_gap": min(gaps)}


def kernel_events(fn, reps: int, trace: Path) -> list[dict]:
    """GPU activity (kernels, copies, fills) of `reps` calls of fn, from a torch.profiler trace."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    trace.unlink()  # several MB; the summary is what we keep
    return events


def profile(runner, start: int, w: int, reps: int, out_dir: Path) -> dict:
    """Kernel time per step by class over `reps` graph replays (un-captured runs if the trace shows no graph kernels)."""
    from draftflow.plugins.target.graphs import bucket_for

    drafts = torch.randint(0, 100, (1, w - 1), device=DEV) if w > 1 else None
    source = "graph replays"
    with torch.inference_mode():
        runner(7, drafts, start)
        torch.cuda.synchronize()
        events = kernel_events(lambda: runner(7, drafts, start), reps, out_dir / f"trace_w{w}.json")
        if sum(e["cat"] == "kernel" for e in events) < 10 * reps:
            source = "un-captured static step (the trace showed no kernels inside graphs); idle time is launch-bound"
            bucket = bucket_for(start + w, runner.cache.capacity, runner.min_bucket)
            events = kernel_events(lambda: runner._run(1, w, bucket), reps, out_dir / f"trace_w{w}.json")
    span_us = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    classes: dict[str, list[float]] = {}
    names: dict[str, float] = {}
    for e in events:
        cls = next(c for c, pattern in KERNEL_CLASSES if re.search(pattern, e["name"], re.IGNORECASE))
        classes.setdefault(cls, []).append(e["dur"])
        names[e["name"][:90]] = names.get(e["name"][:90], 0.0) + e["dur"]
    busy = sum(e["dur"] for e in events)
    return {"window": w, "steps": reps, "source": source, "step_ms": span_us / reps / 1e3,
            "kernels_per_step": len(events) / reps, "busy_ms": busy / reps / 1e3, "idle_ms": (span_us - busy) / reps / 1e3,
            "classes": {c: {"ms": sum(d) / reps / 1e3, "kernels": len(d) / reps} for c, d in classes.items()},
            "top_kernels": sorted(((n, t / reps / 1e3) for n, t in names.items()), key=lambda x: -x[1])[:12]}


def hf_model(model, cfg_dict):
    """transformers' Qwen3ForCausalLM whose parameters are our tensors (no copy)."""
    import transformers

    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type", "rope_theta")},
                                      rope_parameters={"rope_type": "default", "rope_theta": cfg_dict["rope_theta"]})
    with torch.device(DEV):
        hf = transformers.Qwen3ForCausalLM._from_config(hf_cfg, dtype=torch.bfloat16)
    state = {("" if k == "lm_head.weight" else "model.") + k: v for k, v in model.state_dict().items()}
    hf.load_state_dict(state, assign=True, strict=True)
    return hf.eval()


def hf_generate(hf, prompt, new: int, repeats: int, **kw) -> dict:
    ids = torch.tensor([prompt], device=DEV)
    args = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0, eos_token_id=None, **kw)
    rates, out = [], None
    with torch.inference_mode():
        hf.generate(ids, **{**args, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up (compiles, if it will)
        hf.generate(ids, **{**args, "max_new_tokens": 4, "min_new_tokens": 4})
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            out = hf.generate(ids, **args)
            sync()
            rates.append((out.shape[1] - len(prompt)) / (time.perf_counter() - t))
    return {"tok_s_e2e": statistics.median(rates), "tokens": out[0, len(prompt):].tolist()}


def run(a) -> None:
    from draftflow.core.tracing import configure_logging
    from draftflow.layers.config import TargetConfig, weight_bytes
    from draftflow.plugins.target.graphs import GraphRunner, fuse_projections
    from draftflow.layers.kv_cache import KVCache, static_shape

    global DEV
    DEV = "cpu" if a.tiny else "cuda"
    shapes = TINY if a.tiny else QWEN3_8B
    configure_logging(verbose=False)
    t0 = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    r = Results(out / "results.json")
    import transformers

    r.save("env", {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)", "torch": torch.__version__, "cuda": torch.version.cuda,
                   "transformers": transformers.__version__, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new})
    bw = copy_bandwidth()
    cfg = TargetConfig.from_hf_dict(shapes, "qwen3-8b-shapes")
    read_bytes = weight_bytes(cfg, torch.bfloat16) - cfg.vocab_size * cfg.hidden_size * 2  # the embedding is a row lookup
    r.save("floor", {"copy_TBps": bw, "weight_bytes_read": read_bytes, "floor_ms": read_bytes / (bw * 1e12) * 1e3})
    model = build_model(cfg, seed=0)
    r.save("model", {"params": sum(p.numel() for p in model.parameters()), "checksum": checksum(model)})
    if a.quick:
        guarded(r, "cold_start", lambda: cold_start(model, cfg, shapes, a))
        r.save("elapsed_s", time.monotonic() - t0)
        return

    # Raw step times: eager forward, then graph variants (the last is the node's default).
    start = 160
    kv = KVCache.from_static(torch.zeros(static_shape(cfg, 1, 512), dtype=torch.bfloat16, device=DEV))
    with torch.inference_mode():
        model(torch.randint(0, 100, (1, start), device=DEV), 0, kv)
        kv.commit(start)

    def eager_step():
        with torch.inference_mode():
            return {f"w{w}_ms": cuda_ms(lambda w=w: model(torch.ones(1, w, dtype=torch.long, device=DEV), start, kv), 5, 3)
                    for w in (1, 16)}

    guarded(r, "eager_step", eager_step)
    variants, runner = {}, None
    gpu = DEV == "cuda"
    plain = dict(elementwise=False)  # torch ops (or torch.compile'd ones) between the products
    for name, kw in (("graph", dict(compiled=False, fused=False, triton=False, triton_attention=False, **plain)),
                     ("graph+compile", dict(compiled=True, fused=False, triton=False, triton_attention=False, **plain)),
                     ("graph+compile+fused", dict(compiled=True, fused=True, triton=False, triton_attention=False, **plain)),
                     ("graph+compile+fused+triton prologue", dict(compiled=True, fused=True, triton=gpu, triton_attention=False,
                                                                  **plain)),
                     ("graph+compile+fused+triton prologue+split attention",
                      dict(compiled=True, fused=True, triton=gpu, triton_attention=gpu, **plain)),
                     ("graph+fused+triton prologue+split attention+triton add-RMSNorm/SiLU (default, nothing compiled)",
                      dict(compiled=True, fused=True, triton=gpu, triton_attention=gpu, elementwise=gpu))):
        def variant(kw=kw):
            nonlocal runner
            t = time.monotonic()
            runner = GraphRunner(model, kv, 17, capture=DEV == "cuda", **kw)
            return {"w1_ms": time_runner(runner, start, 1, reps=100), "setup_s": time.monotonic() - t}

        variants[name] = guarded(None, name, variant)
        r.save("variants", variants)
    variants["graph loop: replay + argmax + host sync per token"] = guarded(None, "loop", lambda: sync_loop(runner, kv, start, a.new))
    r.save("variants", variants)
    curve = {}
    for w in range(1, 18):
        curve[w] = guarded(None, w, lambda w=w: time_runner(runner, start, w))
        r.save("verify_curve", {"start": start, "ms": curve})
    if DEV == "cuda":
        guarded(r, "profile", lambda: {f"w{n}": profile(runner, start, n, reps, out) for n, reps in ((1, 20), (16, 10))})
    runner = None
    guarded(r, "long_context", lambda: long_context(model, cfg, GraphRunner))

    # The real node in a real graph, eager vs graphs, plus a teacher-forced logit comparison.
    fuse_projections(model)
    cfg_dir = Path(tempfile.mkdtemp())
    (cfg_dir / "config.json").write_text(json.dumps(shapes))
    prompt = torch.randint(0, cfg.vocab_size, (a.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()

    def node_runs():
        ours = {}
        for graphs in (False, True):
            session = open_session(model, cfg, cfg_dir, graphs, max_context=4096)
            ours["graphs" if graphs else "eager"] = run_session(session, prompt, a.new, 1 if not graphs else a.repeats)
            runner = session.executor.nodes["target"].runner
            if graphs and runner is not None:
                ours["graphs"]["captured"] = sorted(runner.graphs)
            del session
            torch.cuda.empty_cache() if DEV == "cuda" else None
        e, g = ours["eager"]["tokens"], ours["graphs"]["tokens"]
        ours["identical_tokens"] = e == g
        ours["first_divergence"] = None if e == g else common_prefix(e, g)
        return ours

    ours = guarded(r, "ours", node_runs)
    eager_tokens = ours.get("eager", {}).get("tokens")
    if eager_tokens:
        guarded(r, "teacher_forced", lambda: teacher_forced(model, cfg, GraphRunner, prompt + eager_tokens, len(prompt), a.new))

    # transformers on the same tensors.
    hf = guarded(None, "hf", lambda: hf_model(model, shapes))
    theirs = {}
    for name, kw, new in (("eager (dynamic cache)", {}, a.hf_new),
                          ("static cache", dict(cache_implementation="static", disable_compile=True), a.hf_new),
                          ("static cache + torch.compile", dict(cache_implementation="static"), a.new)):
        if isinstance(hf, dict):
            theirs[name] = hf  # building the model failed: the error
        elif name.endswith("compile") and time.monotonic() - t0 > a.deadline_s:
            theirs[name] = {"error": f"skipped: {time.monotonic() - t0:.0f} s used of the {a.deadline_s:.0f} s deadline"}
        else:
            t = time.monotonic()
            theirs[name] = guarded(None, name, lambda new=new, kw=kw: hf_generate(hf, prompt, new, 2, **kw))
            theirs[name]["setup_and_run_s"] = time.monotonic() - t
            if eager_tokens and "tokens" in theirs[name]:
                theirs[name]["matches_ours_eager"] = common_prefix(theirs[name]["tokens"], eager_tokens)
        r.save("transformers", theirs)
    r.save("elapsed_s", time.monotonic() - t0)


def guarded(results: Results | None, key, fn):
    """Run one phase; on failure keep going and record the error (and save, if `results` is given)."""
    try:
        value = fn()
    except Exception as exc:  # a failed phase must not lose the others' numbers
        traceback.print_exc()
        value = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    if results is not None:
        results.save(key, value)
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for results.json")
    p.add_argument("--report", help="print the tables of a saved results.json and exit")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--hf-new", type=int, default=32, help="tokens per transformers run without compile (slow)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU: checks this script, measures nothing")
    p.add_argument("--quick", action="store_true", help="only the node as a user gets it: open + warm-up cost, "
                   "the first request, steady decode (the issue-17 gates)")
    p.add_argument("--deadline-s", type=float, default=330, help="skip transformers + compile if this much time has gone")
    a = p.parse_args()
    if a.report:
        report(Path(a.report))
        return
    run(a)
    if a.quick:
        print(json.dumps(json.loads((Path(a.out) / "results.json").read_text()).get("cold_start"), indent=1))
        return
    report(Path(a.out) / "results.json")


if __name__ == "__main__":
    main()
