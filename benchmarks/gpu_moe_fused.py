"""MoE with every expert resident at the Qwen3-30B-A3B shape (random bf16 weights): the device path under CUDA graphs.

    python benchmarks/gpu_moe_fused.py --out DIR          # H200: ~62 GB of weights drawn on the GPU; < 3 min
    python benchmarks/gpu_moe_fused.py --tiny --out DIR   # a CPU dry run at toy shapes (Triton's interpreter)
    python benchmarks/gpu_moe_fused.py --quick --out DIR  # < 40 s: step and window under graphs, few-token vs grouped

--quick times only the graphs (the 1-token step with the few-token kernels and with the grouped
ones, the 16-token window) and one layer's expert launches for 1 and 16 tokens per kernel
choice, each captured in a CUDA graph (ten calls per graph: GPU time without launch overhead),
with each choice's error against a float32 reference (the --tiny dry run's grouped kernels show
huge bf16 errors: Triton's interpreter mishandles bf16 `tl.dot`; on the GPU they are exact).

Measured in one run: the device copy bandwidth and the weight-read floor it implies (every
non-expert weight but the embedding, plus top-k experts per MoE layer for a 1-token step, or
the distinct experts a window routes to for a verify window; benchmarks/gpu_target.py's
copy_bandwidth); the 1-token step and the 16-token verify window replayed as CUDA graphs
(GraphRunner); the same windows eagerly on the device path and on the host-routed expert
cache path (the pre-#19 baseline: one host sync per MoE layer), with host synchronisations
counted by torch's sync debug mode; the distinct experts each window reads (device counter);
and one MoE layer's route + fused experts alone against its own bytes. A random router routes
close to uniformly, so a 16-token window reads about 128 * (1 - (1 - 8/128)^16) = 82 of 128
experts per layer; real checkpoints route with skew and read fewer. Table on stdout, JSON in
DIR/gpu_moe_fused.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads: the kernels run on CPU tensors

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_target as gt  # noqa: E402  (copy bandwidth, CUDA-event timer)
from gpu_moe import QWEN3_30B_A3B, TINY, SyncCounter, random_model  # noqa: E402

DTYPE = torch.bfloat16
START = 128  # prompt tokens prefilled before the timed windows (past FUSED_MAX_TOKENS: the grouped-GEMM path)


def build(cfg, device: str, seed: int):
    """TargetModel with N(0, 0.02) weights and every expert resident in device slots filled in place (no host copy)."""
    from draftflow.layers.moe import HostExperts

    model, gen = random_model(cfg, device, seed)
    with torch.no_grad():
        n, e, i, h = len(cfg.moe_layers), cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        # The "host" stacks are broadcast views of one expert on the device: the cache's construction copies them
        # into its slots, which are then redrawn in place, so the 58 GB of experts exist once, on the device.
        one_gu, one_d = torch.empty(2 * i, h, dtype=DTYPE, device=device), torch.empty(h, i, dtype=DTYPE, device=device)
        model.host_experts = HostExperts(tuple(cfg.moe_layers), one_gu.expand(n, e, 2 * i, h), one_d.expand(n, e, h, i))
        cache = model.set_expert_cache(None)
        cache.slot_gate_up.normal_(0.0, 0.02, generator=gen)
        cache.slot_down.normal_(0.0, 0.02, generator=gen)
    return model


def host_syncs(fn) -> int:
    """Host synchronisations `fn` makes (gpu_moe.SyncCounter: torch's CUDA sync debug mode; 0 on the CPU)."""
    with SyncCounter() as counter:
        fn()
    return counter.count


def distinct_experts(model, run, layers: int) -> float:
    """Distinct experts per MoE layer that one `run()` reads (the device path counts one per expert per layer-window)."""
    cache = model.expert_cache
    gt.sync()
    before = int(cache.tally[:, -2:].sum())  # hits + misses: one per expert a layer-window reads
    run()
    gt.sync()
    return (int(cache.tally[:, -2:].sum()) - before) / layers


COLUMNS = ((16, 16), (16, 32), (32, 32), (32, 64), (64, 64), (64, 128))  # (gate/up, down) columns per program
# few-token kernels: (gate/up columns, K chunks, down columns); the default is small_config's pick
SMALL = ((16, 1, 16), (8, 1, 16), (16, 1, 32), (8, 2, 16), (32, 1, 16), (16, 4, 32))  # (gate/up columns, K chunks, down columns)


def graph_ms(fn, reps: int, rounds: int, calls: int = 10) -> float:
    """GPU time of one `fn()`: `calls` calls captured in one CUDA graph and replayed (no launch overhead)."""
    if gt.DEV == "cpu":
        return gt.cuda_ms(fn, reps=reps, rounds=rounds)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiled and warm before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return gt.cuda_ms(graph.replay, reps=reps, rounds=rounds) / calls


def reference(x, ids, weights, gate_up, down) -> torch.Tensor:
    """The experts' weighted sum in float32, pair by pair (every expert resident: slot = expert)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t, j in ((t, j) for t in range(ids.shape[0]) for j in range(ids.shape[1])):
        e = int(ids[t, j])
        gate, up = (gate_up[e].float() @ x[t].float()).chunk(2)
        out[t] += weights[t, j].float() * (down[e].float() @ (torch.nn.functional.silu(gate) * up))
    return out


def layer_alone(model, cfg, tokens: int, bw: float, reps: int, quick: bool = False) -> dict:
    """One MoE layer on `tokens` random rows: the whole block (router GEMV, route_topk, fused experts, eager) and the
    expert launches alone per kernel choice (`auto`: what the model runs; `grouped`: the by-pair / by-expert kernels,
    also per block width of COLUMNS; `small`: the few-token kernels per config of SMALL where the window fits), eager
    and captured in a CUDA graph, against the bytes they read."""
    from draftflow.layers import moe_kernels as mk
    from draftflow.layers.moe import SparseMoeBlock
    from draftflow.layers.moe_kernels import fused_experts, route_topk

    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))
    layer, cache = block.experts, model.expert_cache
    x = torch.randn(1, tokens, cfg.hidden_size, dtype=DTYPE, device=gt.DEV)
    rounds = 1 if gt.DEV == "cpu" else 5
    with torch.inference_mode():
        block(x)
        experts = distinct_experts(model, lambda: block(x), 1)
        ms = gt.cuda_ms(lambda: block(x), reps=reps, rounds=rounds)
        flat = x.reshape(tokens, -1)
        weights, ids = route_topk(block.gate(flat), block.top_k, block.norm_topk_prob, DTYPE)
        slots = slice(layer.start, layer.start + layer.size)
        args = (flat, ids, weights, cache.slot_gate_up[slots], cache.slot_down[slots], layer.slot_key, cache.tally[layer.row])
        counters = torch.zeros(mk.counter_size(cfg.hidden_size, cfg.moe_intermediate_size), dtype=torch.int32,
                               device=gt.DEV)
        fits = mk.few_token_fits(tokens, block.top_k, DTYPE)
        variants = {"default": {}, "grouped": dict(path="grouped")}
        if fits:
            variants["small"] = dict(path="small")
            variants.update({f"small {c}": dict(path="small", small=c) for c in (() if gt.DEV == "cpu" else SMALL)})
        if not quick and gt.DEV != "cpu":
            variants.update({f"grouped {c}": dict(path="grouped", columns=c) for c in COLUMNS})
        sweep, graphed, errors = {}, {}, {}
        want = reference(*args[:5])
        for name, kw in variants.items():
            fn = lambda kw=kw: fused_experts(*args, counters=counters, **kw)  # noqa: E731
            try:
                err = ((fn().float() - want).abs().max() / want.abs().max()).item()  # vs the grouped kernels
                if not quick:
                    sweep[name] = gt.cuda_ms(fn, reps=reps, rounds=rounds)
                graphed[name] = graph_ms(fn, reps=max(1, reps // 2), rounds=rounds)
                errors[name] = err
            except Exception as exc:  # noqa: BLE001 - one kernel choice failing must not lose the run's other numbers
                errors[name] = f"{type(exc).__name__}: {exc}"[:300]
    read = experts * cache.bytes_per_expert
    best = min(graphed, key=graphed.get)
    gbps = {name: read / (t * 1e-3) / 1e12 for name, t in graphed.items()}
    row = {"tokens": tokens, "block_ms": ms, "distinct_experts": experts, "expert_read_GB": read / 1e9,
           "experts_graph_ms": graphed, "experts_graph_TBps": gbps, "max_rel_err_vs_float32": errors, "best": best,
           "best_of_copy_bw": gbps[best] / bw, "default_of_copy_bw": gbps.get("default", 0.0) / bw}
    if sweep:
        row["experts_eager_ms"] = sweep
    return row


def router_alone(cfg, reps: int) -> dict:
    """The post-attention add + RMSNorm and the router at 1 token, captured in CUDA graphs (us): the Triton add_rms
    then cuBLAS's GEMV then route_topk (three launches) against add_rms_route (one) at each ROUTER_WARPS."""
    from draftflow.layers import moe_router as mr
    from draftflow.layers import triton_kernels as tk

    h, e, k = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
    x, delta = (torch.randn(1, 1, h, device=gt.DEV).to(DTYPE) for _ in range(2))
    norm_w = torch.randn(h, device=gt.DEV).to(DTYPE)
    weight = (torch.randn(e, h, device=gt.DEV) * h ** -0.5).to(DTYPE)
    rounds = 1 if gt.DEV == "cpu" else 5

    def three():
        _, normed = tk.add_rms(x, delta, norm_w, 1e-6)
        return mr.route_topk(torch.nn.functional.linear(normed.view(1, h), weight), k, True, DTYPE)

    out = {"three_launches_us": graph_ms(three, reps, rounds) * 1e3}
    default = mr.ROUTER_WARPS
    for warps in (1, 2, 4, 8):
        mr.ROUTER_WARPS = warps
        try:
            out[f"add_rms_route_warps{warps}_us"] = graph_ms(
                lambda: mr.add_rms_route(x, delta, norm_w, 1e-6, False, weight, k, True), reps, rounds) * 1e3
        finally:
            mr.ROUTER_WARPS = default
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="toy shapes on the CPU through Triton's interpreter (a dry run)")
    p.add_argument("--quick", action="store_true", help="graphs only: step (few-token vs grouped kernels), window, "
                   "one layer's expert launches (< 40 s on an H200)")
    p.add_argument("--verify", type=int, default=16, help="tokens of the verify window")
    p.add_argument("--windows", type=int, default=8, help="random verify windows averaged for the distinct-expert count")
    p.add_argument("--profile", action="store_true", help="also the 1-token step's kernels by class and name "
                   "(torch.profiler over graph replays)")
    p.add_argument("--step-variants", action="store_true", help="also the 1-token step and window with "
                   "triton_kernels.PDL off and on (fresh captures)")
    p.add_argument("--out", required=True, help="folder for gpu_moe_fused.json")
    a = p.parse_args()
    from draftflow.layers import moe_kernels as mk
    from draftflow.layers.config import TargetConfig, weight_bytes
    from draftflow.layers.kv_cache import KVCache, static_shape
    from draftflow.layers.moe import bytes_per_expert, total_experts
    from draftflow.plugins.target.graphs import GraphRunner

    gt.DEV = dev = "cpu" if a.tiny else "cuda"
    began = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = TargetConfig.from_hf_dict({**TINY, "num_hidden_layers": 2} if a.tiny else QWEN3_30B_A3B, "qwen3-30b-a3b-shape")
    reps, rounds = (1, 1) if a.tiny else (20, 5)  # the interpreter runs a window in seconds
    n_windows = min(a.windows, 2) if a.tiny else a.windows
    layers, k, per = len(cfg.moe_layers), cfg.num_experts_per_tok, bytes_per_expert(cfg, DTYPE)
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter dry run)",
           "torch": torch.__version__, "mode": "quick" if a.quick else "full", "moe_layers": layers,
           "experts": cfg.num_experts, "top_k": k, "bytes_per_expert": per}
    bw = gt.copy_bandwidth()  # TB/s, read + written
    dense = weight_bytes(cfg, DTYPE) - per * total_experts(cfg) - cfg.vocab_size * cfg.hidden_size * DTYPE.itemsize
    step_bytes = dense + layers * k * per  # the active weights of one token
    res["floor"] = {"copy_TBps": bw, "active_bytes": step_bytes, "floor_ms": step_bytes / (bw * 1e12) * 1e3,
                    "floor_tok_s": bw * 1e12 / step_bytes}
    model = build(cfg, dev, seed=0)
    cache = model.expert_cache
    if dev == "cpu":
        cache.device_path = True  # the CPU dry run takes the device path through the interpreter
    res["build_s"] = time.monotonic() - began
    w = a.verify
    kv = KVCache.from_static(torch.zeros(static_shape(cfg, 1, START + 2 * w + 64), dtype=DTYPE, device=dev))
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        model(torch.randint(0, cfg.vocab_size, (1, START), generator=gen).to(dev), 0, kv)  # prefill: the long path
        kv.commit(START)
        runner = GraphRunner(model, kv, max_window=w, capture=dev == "cuda")
        drafts = [torch.randint(0, cfg.vocab_size, (1, w - 1), generator=gen).to(dev) for _ in range(n_windows)]
        steps = {}
        for width, d in ((1, None), (w, drafts[0])):
            runner(7, d, START)  # capture (first use)
            steps[width] = gt.cuda_ms(lambda d=d: runner(7, d, START), reps=reps, rounds=rounds)
        one, win = steps[1], steps[w]
        step_experts = distinct_experts(model, lambda: runner(7, None, START), layers)
        timed_experts = distinct_experts(model, lambda: runner(7, drafts[0], START), layers)
        window_floor_ms = (dense + layers * timed_experts * per) / (bw * 1e12) * 1e3
        res["graph"] = {"step_ms": one, "step_tok_s": 1e3 / one, "step_of_floor": res["floor"]["floor_ms"] / one,
                        "step_distinct_experts": step_experts, f"window{w}_ms": win, "window_over_step": win / one,
                        "window_distinct_experts": timed_experts, "window_floor_ms": window_floor_ms,
                        "window_of_its_floor": window_floor_ms / win,
                        "host_syncs_step": host_syncs(lambda: runner(7, None, START)),
                        "host_syncs_window": host_syncs(lambda: runner(7, drafts[0], START))}
        g = res["graph"]
        if a.profile and dev == "cuda":
            res["profile_step"] = gt.profile(runner, START, 1, reps, out)
        if a.step_variants and dev == "cuda":  # the step (and window) with PDL switched off and on, fresh captures
            from draftflow.layers import triton_kernels as tk

            g["step_variants_ms"], g["window_variants_ms"] = {}, {}
            default = tk.PDL
            for use_pdl in (False, True):
                tk.PDL = use_pdl
                try:
                    variant = GraphRunner(model, kv, max_window=w, capture=True)
                    variant(7, None, START)
                    name = "pdl" if use_pdl else "no_pdl"
                    g["step_variants_ms"][name] = gt.cuda_ms(lambda: variant(7, None, START), reps=reps, rounds=rounds)
                    g["window_variants_ms"][name] = gt.cuda_ms(lambda: variant(7, drafts[0], START), reps=reps,
                                                               rounds=rounds)
                    del variant
                finally:
                    tk.PDL = default
        # The same 1-token step with the grouped kernels (the few-token ones switched off): a fresh runner, so a
        # fresh capture
        mk.FEW_TOKEN_KERNELS = False
        try:
            old_runner = GraphRunner(model, kv, max_window=w, capture=dev == "cuda")
            old_runner(7, None, START)
            g["step_grouped_kernels_ms"] = gt.cuda_ms(lambda: old_runner(7, None, START), reps=reps, rounds=rounds)
            g["step_grouped_kernels_of_floor"] = res["floor"]["floor_ms"] / g["step_grouped_kernels_ms"]
            del old_runner
        except Exception as exc:  # noqa: BLE001 - the comparison is optional; keep the run's other numbers
            g["step_grouped_kernels_error"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            mk.FEW_TOKEN_KERNELS = True
        if not a.quick:
            same = torch.full((1, w - 1), 7, dtype=torch.long, device=dev)  # every token alike: routing alike
            g["same_token_window_ms"] = gt.cuda_ms(lambda: runner(7, same, START), reps=reps, rounds=rounds)
            g["random_windows_distinct_experts_mean"] = sum(
                distinct_experts(model, lambda d=d: runner(7, d, START), layers) for d in drafts) / len(drafts)
            g["same_token_window_distinct_experts"] = distinct_experts(model, lambda: runner(7, same, START), layers)
            # Eager windows: the device path (no host sync) and the host-routed expert cache (one sync per MoE layer).
            eager = {}
            for device_path in (True, False):
                cache.device_path = device_path
                name = "device" if device_path else "host_routed"
                for width, d in ((1, None), (w, drafts[0])):
                    window = torch.cat([torch.full((1, 1), 7, device=dev)] + ([d] if d is not None else []), dim=1)
                    fn = lambda window=window: model(window, START, kv)  # noqa: E731
                    fn()
                    eager[f"{name}_w{width}_ms"] = gt.cuda_ms(fn, reps=max(1, reps // 4), rounds=min(rounds, 3))
                    eager[f"{name}_w{width}_host_syncs"] = host_syncs(fn)
            cache.device_path = True
            res["eager"] = eager
        res["layer_alone"] = [layer_alone(model, cfg, t, bw, reps, a.quick) for t in (1, w)]
        res["router_alone"] = router_alone(cfg, reps)
    res["elapsed_s"] = time.monotonic() - began
    (out / "gpu_moe_fused.json").write_text(json.dumps(res, indent=1))
    report(res, cfg, w, out)


def report(res: dict, cfg, w: int, out: Path) -> None:
    f, g = res["floor"], res["graph"]
    for name, ms in g.get("step_variants_ms", {}).items():
        win = g.get("window_variants_ms", {}).get(name)
        print(f"1-token step, {name}: {ms:.3f} ms = {f['floor_ms'] / ms:.1%} of the floor"
              + (f"; {w}-token window {win:.3f} ms = {win / ms:.2f}x" if win else ""))
    if "router_alone" in res:
        print("post-attention add + RMSNorm + router, 1 token, CUDA graph (us): "
              + ", ".join(f"{name[:-3]} {us:.2f}" for name, us in res["router_alone"].items()))
    if "profile_step" in res:
        prof = res["profile_step"]
        print(f"1-token step profile ({prof['source']}): {prof['kernels_per_step']:.0f} kernels, busy "
              f"{prof['busy_ms']:.3f} ms, idle {prof['idle_ms']:.3f} ms of {prof['step_ms']:.3f} ms")
        for name, cls in prof["classes"].items():
            print(f"    {name:44}{cls['ms']:>8.3f} ms{cls['kernels']:>6.0f} kernels")
        for name, ms in prof["top_kernels"]:
            print(f"    {ms:>8.3f} ms  {name}")
    one, win = g["step_ms"], g[f"window{w}_ms"]
    print(f"MoE, every expert resident: {res['device']}, torch {res['torch']}; {res['moe_layers']} MoE layers x "
          f"{cfg.num_experts} experts of {res['bytes_per_expert'] / 2**20:.2f} MiB, top-{res['top_k']}; copy "
          f"{f['copy_TBps']:.2f} TB/s ({res['mode']} run)")
    print(f"{'':40}{'ms':>9}{'tok/s':>9}{'floor ms':>10}{'of floor':>9}{'experts/layer':>14}{'host syncs':>11}")
    print(f"{'1-token step, CUDA graph':40}{one:>9.3f}{1e3 / one:>9.1f}{f['floor_ms']:>10.3f}{g['step_of_floor']:>9.1%}"
          f"{g['step_distinct_experts']:>14.1f}{g['host_syncs_step']:>11}")
    if "step_grouped_kernels_ms" in g:
        old = g["step_grouped_kernels_ms"]
        print(f"{'1-token step, graph, grouped kernels':40}{old:>9.3f}{1e3 / old:>9.1f}{f['floor_ms']:>10.3f}"
              f"{g['step_grouped_kernels_of_floor']:>9.1%}")
    else:
        print(f"1-token step with the grouped kernels failed: {g.get('step_grouped_kernels_error')}")
    print(f"{f'{w}-token window, CUDA graph':40}{win:>9.3f}{w * 1e3 / win:>9.1f}{g['window_floor_ms']:>10.3f}"
          f"{g['window_of_its_floor']:>9.1%}{g['window_distinct_experts']:>14.1f}{g['host_syncs_window']:>11}")
    if "same_token_window_ms" in g:
        same_ms = g["same_token_window_ms"]
        print(f"{f'{w}-token window of one token, graph':40}{same_ms:>9.3f}{w * 1e3 / same_ms:>9.1f}{'':>10}{'':>9}"
              f"{g['same_token_window_distinct_experts']:>14.1f}")
    for name in ("device", "host_routed") if "eager" in res else ():
        for width in (1, w):
            ms = res["eager"][f"{name}_w{width}_ms"]
            print(f"{f'{width}-token, eager, {name}':40}{ms:>9.3f}{width * 1e3 / ms:>9.1f}{'':>10}{'':>9}{'':>14}"
                  f"{res['eager'][f'{name}_w{width}_host_syncs']:>11}")
    print(f"{w}-token window / 1-token step (graphs): {g['window_over_step']:.2f}x"
          + (f"; distinct experts per layer over random windows: {g['random_windows_distinct_experts_mean']:.1f}"
             if "random_windows_distinct_experts_mean" in g else ""))
    for row in res["layer_alone"]:
        print(f"one MoE layer, {row['tokens']:>2} tokens, {row['distinct_experts']:.0f} experts "
              f"({row['expert_read_GB'] * 1e3:.0f} MB): block {row['block_ms'] * 1e3:.1f} us eager; expert launches "
              f"in a CUDA graph (us, TB/s, max error / max of a float32 reference):")
        for name, t in row["experts_graph_ms"].items():
            print(f"    {name:24}{t * 1e3:>9.1f}{row['experts_graph_TBps'][name]:>7.2f}  "
                  f"{row['max_rel_err_vs_float32'][name]:.1e}")
        for name, err in row["max_rel_err_vs_float32"].items():
            if isinstance(err, str):
                print(f"    {name:24} failed: {err}")
        print(f"    default {row['default_of_copy_bw']:.0%} of copy bandwidth, best {row['best']} "
              f"{row['best_of_copy_bw']:.0%}")
    print(f"elapsed {res['elapsed_s']:.0f} s; JSON: {out / 'gpu_moe_fused.json'}")


if __name__ == "__main__":
    main()
