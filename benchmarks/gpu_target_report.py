"""The tables of a saved `benchmarks/gpu_target.py` results.json (`gpu_target.py --report FILE` prints them)."""

from __future__ import annotations

import json
from pathlib import Path


def report(path: Path) -> None:
    r = json.loads(path.read_text())
    env, floor = r.get("env", {}), r.get("floor", {})
    print(f"\n## {env.get('gpu')} — torch {env.get('torch')} (CUDA {env.get('cuda')}), transformers {env.get('transformers')}")
    print(f"Qwen3-8B shapes, random bf16 weights; prompt {env.get('prompt_tokens')} tokens, greedy, batch 1\n")
    if floor:
        print(f"copy bandwidth (read+write): {floor['copy_TBps']:.2f} TB/s; bytes read per token: "
              f"{floor['weight_bytes_read'] / 1e9:.2f} GB; floor {floor['floor_ms']:.3f} ms/token "
              f"({1e3 / floor['floor_ms']:.0f} tokens/s)\n")
    fl = floor.get("floor_ms")
    pct = (lambda ms: f"{100 * fl / ms:.1f}%") if fl else (lambda ms: "-")
    print("| engine | tokens/s | ms/token | % of floor |\n|---|---:|---:|---:|")
    ours = r.get("ours", {})
    if "error" in ours:
        print(f"| draftflow target node | — | — | {ours['error'][:80]} |")
        ours = {}
    for key, label in (("graphs", "draftflow target node, CUDA graphs (default)"), ("eager", "draftflow target node, eager")):
        if key in ours:
            for kind in ("decode", "e2e"):
                rate = ours[key][f"tok_s_{kind}"]
                print(f"| {label}, {'decode only' if kind == 'decode' else 'end to end'} | {rate:.1f} | {1e3 / rate:.3f} | {pct(1e3 / rate)} |")
    for name, v in r.get("variants", {}).items():
        if "error" in v:
            print(f"| raw replay, {name} | — | — | {v['error'][:80]} |")
            continue
        print(f"| raw replay, {name} (W=1, no verifier/executor) | {1e3 / v['w1_ms']:.1f} | {v['w1_ms']:.3f} | {pct(v['w1_ms'])} |")
    for name, v in r.get("transformers", {}).items():
        if "error" in v:
            print(f"| transformers generate, {name} | — | — | {v['error'][:80]} |")
        else:
            print(f"| transformers generate, {name}, end to end | {v['tok_s_e2e']:.1f} | {1e3 / v['tok_s_e2e']:.3f} | {pct(1e3 / v['tok_s_e2e'])} |")
    if ours:
        print(f"\ngraphs vs eager, greedy {env.get('new_tokens')} tokens: identical={ours['identical_tokens']}, "
              f"first divergence at {ours['first_divergence']}")
    if "teacher_forced" in r and "error" not in r["teacher_forced"]:
        t = r["teacher_forced"]
        print(f"teacher-forced: argmax agrees {t['argmax_agree']}/{t['steps']}, max |Δlogit| {t['max_abs_logit_diff']:.4f}, "
              f"median {t['median_abs_logit_diff']:.4f}, smallest top-2 gap {t['min_top2_gap']:.4f}, flips at {t['flip_steps']}")
    for name, v in r.get("transformers", {}).items():
        if "matches_ours_eager" in v:
            print(f"transformers {name}: first {v['matches_ours_eager']} tokens equal ours (eager)")
    if "verify_curve" in r:
        ms = {int(k): v for k, v in r["verify_curve"]["ms"].items() if isinstance(v, float)}
        print(f"\nverify cost, W-token window at position {r['verify_curve']['start']} (graph replay incl. input copies):\n")
        print("| W | ms | × 1-token step |\n|---:|---:|---:|")
        for w in sorted(ms):
            print(f"| {w} | {ms[w]:.3f} | {ms[w] / ms[1]:.3f} |" if 1 in ms else f"| {w} | {ms[w]:.3f} | — |")
    if isinstance(r.get("long_context"), dict) and "error" not in r["long_context"]:
        print("\ngraph replay vs context length (ms):\n\n| attention, position, window | ms |\n|---|---:|")
        for name, v in r["long_context"].items():
            print(f"| {name} | {v:.3f} |")
    if "eager_step" in r and "error" not in r["eager_step"]:
        print(f"\neager forward (no graphs): W=1 {r['eager_step']['w1_ms']:.2f} ms, W=16 {r['eager_step']['w16_ms']:.2f} ms")
    prof = r.get("profile", {})
    for key, p in ({"all": prof} if "error" in prof else prof).items():
        if "error" in p:
            print(f"\nprofile {key}: {p['error']}")
            continue
        print(f"\nprofile, W={p['window']} ({p['source']}): {p['step_ms']:.3f} ms/step, {p['kernels_per_step']:.0f} kernels/step, "
              f"busy {p['busy_ms']:.3f} ms, idle between kernels {p['idle_ms']:.3f} ms\n")
        print("| kernel class | ms/step | kernels/step | share |\n|---|---:|---:|---:|")
        for c, v in sorted(p["classes"].items(), key=lambda x: -x[1]["ms"]):
            print(f"| {c} | {v['ms']:.3f} | {v['kernels']:.0f} | {100 * v['ms'] / p['step_ms']:.1f}% |")
        print(f"| (idle: gaps between kernels) | {p['idle_ms']:.3f} | | {100 * p['idle_ms'] / p['step_ms']:.1f}% |")
        if key == "w1" and fl:
            gemm = p["classes"].get("GEMM/GEMV (cuBLAS)", {}).get("ms")
            if gemm:
                print(f"\nGEMV bandwidth: {floor['weight_bytes_read'] / (gemm * 1e-3) / 1e12:.2f} TB/s over the weights")
        print("\ntop kernels: " + "; ".join(f"{n} {t:.3f} ms" for n, t in p["top_kernels"][:6]))
