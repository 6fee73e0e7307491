"""The user's path, cold: `draftflow generate` from a fresh process on a checkpoint on local disk.

Writes a random-weight bf16 checkpoint of the given shape (default: Qwen3-8B) in Hugging
Face layout, then runs the installed CLI on it in new processes, each timed from the
outside (interpreter start-up, imports, load, warm-up, prefill and decode all included):

    python benchmarks/cli_cold.py --out DIR [--model-dir DIR] [--runs 3] [--new 256]

The first run also pays torch.compile's on-disk cache (TORCHINDUCTOR_CACHE_DIR) being cold,
later runs find it warm. It prints one table row per run: wall seconds, the reported
load_s / warmup_s / ttft_s / prefill_ms / tokens_per_s, answer_s (when the JSON line
arrived; the rest of wall_s is process exit), and wall minus load_s, which is
what issue 17 bounds (at most 6 s for 256 tokens on the H200). `--tiny` checks the script
on the CPU with a 2-layer model; it measures nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

QWEN3_8B = dict(vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8, intermediate=12288, context=40960)
TINY = dict(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, context=2048)


def write_checkpoint(out: Path, shape: dict, dtype: str, device: str) -> float:
    """A random-weight checkpoint at `out` (config.json + one safetensors file per layer group); returns seconds taken."""
    import torch
    from safetensors.torch import save_file

    from draftflow.layers.config import TargetConfig, expected_tensors
    from draftflow.tools.tiny_model import hf_config

    began = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    config = {**hf_config(**shape), "torch_dtype": dtype}
    cfg = TargetConfig.from_hf_dict(config, "bench")
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = expected_tensors(cfg)
    shards: list[dict] = [{}]
    size = 0
    index = {}
    for name, tshape in tensors.items():
        t = torch.randn(tshape, generator=gen, device=device, dtype=torch.float32) * 0.02
        if name.endswith("norm.weight"):
            t = torch.ones(tshape, device=device)
        shards[-1][name] = t.to(getattr(torch, dtype)).cpu()
        size += shards[-1][name].numel() * shards[-1][name].element_size()
        if size > 4 << 30:
            shards.append({})
            size = 0
    for i, shard in enumerate(s for s in shards if s):
        file = f"model-{i + 1:05d}.safetensors"
        save_file(shard, str(out / file))
        index.update({k: file for k in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (out / "config.json").write_text(json.dumps(config))
    return time.perf_counter() - began


def run_cli(model: Path, device: str, dtype: str, new: int, prompt_ids: str) -> dict:
    cmd = ["draftflow", "generate", "--target", str(model), "--device", device, "--dtype", dtype,
           "--max-new-tokens", str(new), "--ignore-eos", "--json", "--prompt-ids", prompt_ids]
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()  # the one JSON line: when the answer is there
    answered = time.perf_counter() - began
    rest, err = proc.communicate()
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    out = json.loads((line + rest).strip().splitlines()[-1])
    stats = out.get("stats", out)
    return {"command": " ".join(cmd), "wall_s": round(wall, 3), "answer_s": round(answered, 3), "tokens": len(out.get("token_ids", [])),
            **{k: stats.get(k) for k in ("load_s", "warmup_s", "ttft_s", "prefill_ms", "tokens_per_s")},
            "beyond_load_s": round(wall - (stats.get("load_s") or 0.0), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json")
    p.add_argument("--model-dir", help="checkpoint folder (written if it has no config.json); default OUT/model")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="2-layer model on the CPU: checks the script, measures nothing")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(a.model_dir) if a.model_dir else out / "model"
    device, dtype, shape = ("cpu", "float32", TINY) if a.tiny else ("cuda", "bfloat16", QWEN3_8B)
    results = {"shape": shape, "device": device, "dtype": dtype, "runs": []}
    if not (model / "config.json").is_file():
        results["write_s"] = round(write_checkpoint(model, shape, dtype, device), 1)
    prompt = ",".join(str((1000 + i * 7919) % shape["vocab"]) for i in range(a.prompt_tokens))
    print(f"{'run':>3} {'wall_s':>7} {'answer_s':>8} {'load_s':>7} {'warmup_s':>8} {'ttft_s':>7} {'prefill_ms':>10} {'tok/s':>7} {'wall-load':>9}")
    for i in range(a.runs):
        r = run_cli(model, device, dtype, a.new, prompt)
        results["runs"].append(r)
        print(f"{i:>3} {r['wall_s']:>7.2f} {r['answer_s']:>8.2f} {r['load_s'] or 0:>7.2f} {r['warmup_s'] or 0:>8.2f} {r['ttft_s'] or 0:>7.3f} "
              f"{r['prefill_ms'] or 0:>10.1f} {r['tokens_per_s'] or 0:>7.1f} {r['beyond_load_s']:>9.2f}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"command: {results['runs'][0]['command']}", file=sys.stderr)


if __name__ == "__main__":
    main()
