"""Build the shipped demo pair: a small Qwen3 code model and its DFlash, DFlash2 and MTP drafters.

    python -m draftflow.tools.make_demo [--out graphs/models/demo] [--work /tmp/draftflow-demo]
                                        [--stage all|target|dflash|dflash2|mtp] [--target-minutes 11]
                                        [--drafter-minutes 7] [--device cpu|cuda] [--batch-size 8] [--regen-windows 32768]

1. target: Python sources of this machine (standard library and installed packages, tests
   excluded) train a byte-level BPE tokenizer (tools/tiny_model's, plus a `<|mask|>` token for
   DFlash) and a 4-layer Qwen3 model from scratch (causal LM loss, the shared training loop).
2. dflash / dflash2 / mtp: `draftflow train dflash|dflash2|mtp` against that frozen target, on
   the same text (block drafters on windows the target regenerated, `--labels regenerate`). DFlash2 gets DFlash's shape and recipe (trained from scratch, so the two are
   compared at equal budgets) plus its selector (rank 64: the demo vocabulary is 2,048).

Everything is bounded in wall time (CPU budgets), so the result depends on the machine's
speed; the numbers of a run are written to WORK/summary.json for the model card.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from draftflow.layers.config import TargetConfig
from draftflow.plugins.target.model import TargetModel
from draftflow.tools.tiny_model import EOS, hf_config, train_tokenizer
from draftflow.tools.train.data import TokenData, WindowSampler, read_texts, source_files, tokenizer_encoder
from draftflow.tools.train.loop import TrainOptions, WindowKV, init_weights, train

MASK = "<|mask|>"
# Demo target shape: ~1 M parameters, small enough to train on two CPU cores in minutes.
TARGET_SHAPE = {"vocab": 2048, "hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 384, "context": 512}


class LanguageModelRecipe:
    """Next-token cross-entropy for the target itself."""

    def __init__(self, model: TargetModel) -> None:
        self.module = model

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: [B, S]
        logits, _ = self.module(tokens[:, :-1], 0, WindowKV())  # [B, S-1, V]
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def evaluate(self, windows: list[torch.Tensor]) -> dict[str, float]:
        losses = [float(self.loss(w[None])) for w in windows]
        return {"loss": sum(losses) / max(1, len(losses))}


def save_target(model: TargetModel, config: dict, tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {(n if n.startswith("lm_head.") else "model." + n): t.detach().contiguous()
             for n, t in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))


def make_target(out: Path, work: Path, minutes: float, seed: int, summary: dict) -> None:
    t0 = time.perf_counter()
    files = source_files()
    texts = read_texts(files, max_bytes=8_000_000, seed=seed)
    shape = TARGET_SHAPE
    tok = train_tokenizer(shape["vocab"] - 1, texts[: len(texts) // 2])
    tok.add_special_tokens([MASK])
    vocab = tok.get_vocab_size()
    data = TokenData.from_texts(texts, tokenizer_encoder(tok), eos_id=tok.token_to_id(EOS), seed=seed)
    config = hf_config(vocab, shape["hidden"], shape["layers"], shape["heads"], shape["kv_heads"], shape["intermediate"],
                       shape["context"])
    config["tie_word_embeddings"] = True
    model = TargetModel(TargetConfig.from_hf_dict(config, "demo target"))
    init_weights(model, seed=seed)
    # Short windows, many updates: on a CPU budget the step count, not the context, limits the loss.
    sampler = WindowSampler(data, seq_len=65, seed=seed)
    opts = TrainOptions(steps=100_000, batch_size=8, lr=3e-3, warmup=0.03, eval_every=100, eval_windows=16, save_every=100,
                        checkpoint=work / "target.pt", resume=True, time_budget_s=minutes * 60)
    result = train(LanguageModelRecipe(model), sampler, opts, label="target")
    save_target(model, config, tok, out / "target")
    summary["target"] = {
        "files_found": len(files), "documents": data.documents, "characters": data.characters,
        "train_tokens": int(data.train.numel()), "held_out_tokens": int(data.held_out.numel()), "vocab": vocab,
        "parameters": sum(p.numel() for p in model.parameters()), "shape": shape, "steps": result.steps,
        "tokens_seen": result.steps * opts.batch_size * (sampler.seq_len - 1), "train_seconds": round(result.elapsed_s),
        "first_loss": _mean(result.losses[:10]), "last_loss": _mean(result.losses[-10:]),
        "held_out": result.evaluations[-1][1], "wall_seconds": round(time.perf_counter() - t0),
        "python": sys.version.split()[0],
    }


def _mean(losses: list[tuple[int, float]]) -> float:
    return round(sum(v for _, v in losses) / max(1, len(losses)), 4)


def make_drafter(kind: str, out: Path, work: Path, minutes: float, seed: int, summary: dict, device: str = "cpu",
                 batch_size: int = 8, regen_windows: int = 32768) -> None:
    from draftflow.tools.train.cli import main as train_main

    args = [kind, "--target", str(out / "target"), "--out", str(out / kind), "--checkpoint", str(work / f"{kind}.pt"),
            "--resume", "--time-budget-min", str(minutes), "--steps", "100000", "--seed", str(seed),
            "--max-data-mb", "8", "--summary", str(work / f"{kind}.json"), "--device", device, "--seq-len", "128",
            "--batch-size", str(batch_size), "--lr", "3e-3", "--eval-every", "100", "--save-every", "50"]
    if kind == "mtp":
        args += ["--labels", "target"]
    else:  # blocks need the target's own chain as labels (docs/TRAINING.md)
        args += ["--labels", "regenerate", "--regen-windows", str(regen_windows), "--gguf", str(work / f"{kind}.gguf"),
                 "--layers", "2", "--block-size", "8", "--anchors", "16"]
    if kind == "dflash2":
        args += ["--selector-rank", "64", "--selector-top-k", "16", "--conv-kernel-size", "2", "--conv-group-size", "16"]
    code = train_main(args)
    if code:
        raise SystemExit(code)
    summary[kind] = json.loads((work / f"{kind}.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m draftflow.tools.make_demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "graphs" / "models" / "demo"))
    p.add_argument("--work", default="/tmp/draftflow-demo", help="checkpoints and the run summary")
    p.add_argument("--stage", choices=("all", "target", "dflash", "dflash2", "mtp"), default="all")
    p.add_argument("--target-minutes", type=float, default=11.0)
    p.add_argument("--drafter-minutes", type=float, default=7.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="device of the drafter stages (the target stage runs on the CPU)")
    p.add_argument("--batch-size", type=int, default=8, help="drafter batch size (the GPU run of the card used 64)")
    p.add_argument("--regen-windows", type=int, default=32768, help="regenerated windows for the block drafters")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    out, work = Path(a.out), Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    summary_file = work / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    if a.stage in ("all", "target"):
        make_target(out, work, a.target_minutes, a.seed, summary)
        summary_file.write_text(json.dumps(summary, indent=2) + "\n")
    for kind in ("dflash", "dflash2", "mtp"):
        if a.stage in ("all", kind):
            make_drafter(kind, out, work, a.drafter_minutes, a.seed, summary, a.device, a.batch_size, a.regen_windows)
            summary_file.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
