"""Held-out tau of trained drafters, two ways: training's one-cycle estimate and a decode like the runtime's.

    python benchmarks/held_out_tau.py [--demo DIR] [--drafters DFlash DFlash2] [--windows 64] [--seq-len 256]
                                      [--decode-tokens 128] [--json F]

The windows are the ones `draftflow train` holds out (same text source, seed and window
length as `make_demo`'s drafter runs: this machine's Python sources, 32 MB, seed 0). For each
drafter of the demo folder (float32 on the CPU):
- `tau`: one greedy cycle of K drafts per window at its midpoint (what training prints);
- `tau_decode`: `--decode-tokens` tokens decoded from the same midpoints, drafting after every
  verdict with a fixed K as the executor does (`tools/train/loop.decode_acceptance`, which a test
  checks against the executor's own counts). This is the number `bench_humaneval` measures on its
  prompts, so it is the one to choose training recipes on.
The table and the JSON hold both, with the per-window time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from draftflow.plugins.dflash import dflash2_loader, loader
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.tools.bench_humaneval import DEMO
from draftflow.tools.train.data import TokenData, WindowSampler, read_texts, source_files, tokenizer_encoder
from draftflow.tools.train.dflash2_recipe import DFlash2Recipe
from draftflow.tools.train.dflash_recipe import DFlashRecipe
from draftflow.tools.train.loop import estimate_acceptance

DRAFTERS = {"DFlash": ("dflash", loader, DFlashRecipe), "DFlash2": ("dflash2", dflash2_loader, DFlash2Recipe)}


def held_out_windows(tokenizer, eos: int, count: int, seq_len: int, max_mb: float, seed: int) -> list[torch.Tensor]:
    """The windows `draftflow train --eval-windows count --seq-len seq_len --max-data-mb max_mb --seed seed` holds out
    (default text source)."""
    texts = read_texts(source_files(), int(max_mb * 1e6), seed=seed)
    data = TokenData.from_texts(texts, tokenizer_encoder(tokenizer), eos_id=eos, seed=seed)
    return WindowSampler(data, seq_len, seed=seed).held_out(count)


def measure(name: str, demo: Path, target, windows: list[torch.Tensor], decode_tokens: int) -> dict:
    folder, module, recipe_cls = DRAFTERS[name]
    drafter, _ = module.load_drafter(demo / folder, "cpu", torch.float32)
    recipe = recipe_cls(target, drafter.eval())
    cfg = recipe.config  # the block backbone's config (DFlash2's too)
    began = time.perf_counter()
    with torch.no_grad():
        out = estimate_acceptance(target, windows, cfg.target_layer_ids, cfg.block_size - 1, recipe.propose,
                                  decode_tokens)
    return {**{k: round(v, 4) for k, v in out.items()}, "num_draft": cfg.block_size - 1,
            "s_per_window": round((time.perf_counter() - began) / max(1, len(windows)), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", default=str(DEMO), help="folder with target/ and the drafters (default: the shipped pair)")
    p.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS))
    p.add_argument("--windows", type=int, default=64, help="held-out windows (make_demo's --eval-windows)")
    p.add_argument("--seq-len", type=int, default=256, help="window length (make_demo's --drafter-seq-len)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens decoded per window (bench_humaneval: 128)")
    p.add_argument("--max-data-mb", type=float, default=32.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    demo = Path(a.demo)
    loaded = load_hf(demo / "target", "cpu", torch.float32)
    windows = held_out_windows(loaded.tokenizer, loaded.eos_ids[0] if loaded.eos_ids else 0, a.windows, a.seq_len,
                               a.max_data_mb, a.seed)
    results = {"windows": len(windows), "seq_len": a.seq_len, "decode_tokens": a.decode_tokens, "drafters": {}}
    print(f"{'drafter':10}{'K':>4}{'tau (1 cycle)':>15}{'tau_decode':>12}{'acceptance_decode':>19}{'s/window':>10}")
    for name in a.drafters:
        row = results["drafters"][name] = measure(name, demo, loaded.model, windows, a.decode_tokens)
        print(f"{name:10}{row['num_draft']:>4}{row['tau']:>15.3f}{row['tau_decode']:>12.3f}"
              f"{row['acceptance_decode']:>19.3f}{row['s_per_window']:>10.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
