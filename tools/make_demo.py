"""Build the shipped demo pair: a small Qwen3 code model and its DFlash, DFlash2 and MTP drafters.

    python -m draftflow.tools.make_demo [--out graphs/models/demo] [--work /tmp/draftflow-demo]
                                        [--stage all|target|dflash|dflash2|mtp] [--device cpu|cuda]
                                        [--target-minutes 11] [--drafter-minutes 7] [--data-mb 8] ...

1. target: Python sources of this machine (standard library and installed packages, tests
   excluded; 2% of the files held out) train a byte-level BPE tokenizer (tools/tiny_model's,
   plus a `<|mask|>` token for DFlash) and a Qwen3 model from scratch (causal LM loss, the
   shared training loop, bf16 autocast on CUDA). The weights are stored in `--save-dtype`
   (bfloat16: half the bytes; the CPU graphs load them as float32). With `--grow-from TARGET_DIR` the stage
   starts from a trained target instead (its tokenizer and weights), grown to `--target-layers` by identity
   layers (tools/train/grow_target.py), and copies the block drafters beside it to OUT with their taps moved.
2. dflash / mtp: `draftflow train dflash|mtp` against that frozen target (block drafter on
   windows the target regenerated, `--labels regenerate`; block 16, taps spread over the
   target); dflash2: `draftflow train dflash2 --init-from` the DFlash drafter (its backbone)
   plus dynamic convolutions and the candidate selector. Drafter weights are stored in
   `--save-dtype` too.

Every stage is bounded in wall time, so the result depends on the machine's speed. Each
stage writes its numbers to WORK/STAGE.json (stages may run at the same time, e.g. dflash
and mtp on one GPU); WORK/summary.json collects them for the model card.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from draftflow.core.errors import DraftflowError
from draftflow.layers.config import TargetConfig
from draftflow.plugins.mtp.weights import LAYOUTS as MTP_LAYOUTS
from draftflow.plugins.target.model import TargetModel
from draftflow.tools.tiny_model import EOS, hf_config, train_tokenizer
from draftflow.tools.train.data import TokenData, WindowSampler, read_texts, source_files, tokenizer_encoder
from draftflow.tools.train.grow_target import grow_target, retap_drafter
from draftflow.tools.train.loop import TrainOptions, WindowKV, greedy_continuation, init_weights, train

MASK = "<|mask|>"
STAGES = ("target", "dflash", "dflash2", "mtp")
# Demo target shape: ~20.5 M parameters (40.9 MB in bf16), so the four demo folders (the MTP head sharing the
# target's LM head) stay under 64 MB.
TARGET_SHAPE = {"vocab": 8192, "hidden": 384, "layers": 11, "heads": 6, "kv_heads": 2, "intermediate": 1024,
                "context": 1024}
# Block drafters: 2 layers, block 16 (anchor + 15 drafts), three taps spread over the target (`spread_taps`).
DRAFTER_SHAPE = {"layers": 2, "block_size": 16}
BLOCK_DRAFTERS = ("dflash", "dflash2")
# The MTP head shares the target's LM head (3.7 MB instead of 10.0): the 64 MB cap needs it beside an 11-layer target.
DEMO_MTP_LAYOUT = "qwen3-next"
TOKENIZER_TEXT = 40_000_000  # characters the BPE is trained on (the rest is only encoded)
SAMPLE_PROMPTS = ("def fibonacci(n):", "import os\n\n\ndef main(", "class Stack:\n    def __init__(self):\n")


class LanguageModelRecipe:
    """Next-token cross-entropy for the target itself."""

    def __init__(self, model: TargetModel) -> None:
        self.module = model

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: [B, S]
        logits, _ = self.module(tokens[:, :-1], 0, WindowKV())  # [B, S-1, V]
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    def evaluate(self, windows: list[torch.Tensor]) -> dict[str, float]:
        dev = self.module.norm.weight.device
        losses = [float(self.loss(w[None].to(dev))) for w in windows]
        return {"loss": sum(losses) / max(1, len(losses))}


def save_target(model: TargetModel, config: dict, tokenizer, out: Path, dtype: torch.dtype) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {(n if n.startswith("lm_head.") else "model." + n): t.detach().to("cpu", dtype).contiguous()
             for n, t in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = dict(config, torch_dtype=str(dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))


def samples(model: TargetModel, tokenizer, n: int = 96) -> dict[str, str]:
    """The target's greedy continuation of each sample prompt (for the model card)."""
    dev = model.norm.weight.device
    out = {}
    with torch.no_grad():
        for prompt in SAMPLE_PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids], device=dev)
            tokens, _ = greedy_continuation(model, ids, n, ())
            out[prompt] = tokenizer.decode(tokens.tolist(), skip_special_tokens=False)
    return out


def make_target(a, out: Path, work: Path) -> dict:
    t0 = time.perf_counter()
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json")
               if a.grow_from and not (Path(a.grow_from) / f).is_file()]
    if missing:
        raise DraftflowError(f"--grow-from {a.grow_from}: no {', '.join(missing)}; give a trained target's folder "
                             "(config.json, model.safetensors, tokenizer.json)")
    if a.grow_train == "new" and not a.grow_from:
        raise DraftflowError("--grow-train new trains only the layers --grow-from inserts; give --grow-from TARGET_DIR "
                             "or drop --grow-train")
    shape = dict(TARGET_SHAPE, layers=a.target_layers)
    if a.grow_from:  # the trained target's tokenizer and weights, deeper (checked before any text is read)
        tok = Tokenizer.from_file(str(Path(a.grow_from) / "tokenizer.json"))
        model, config, mapping = grow_target(a.grow_from, a.target_layers, seed=a.seed)
        if a.grow_train == "new":  # only the inserted layers learn: every trained layer's output stays as it was
            model.requires_grad_(False)
            for i, old in enumerate(mapping):
                model.layers[i].requires_grad_(old is None)
    files = source_files()
    texts = read_texts(files, max_bytes=int(a.data_mb * 1e6), seed=a.seed)
    if not a.grow_from:
        tok = _new_tokenizer(texts, shape["vocab"])
    vocab = tok.get_vocab_size()
    data = TokenData.from_texts(texts, tokenizer_encoder(tok), eos_id=tok.token_to_id(EOS), seed=a.seed)
    print(f"target: {len(texts)} files, {data.train.numel()} training tokens, {data.held_out.numel()} held out, "
          f"vocab {vocab} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if not a.grow_from:
        config = hf_config(vocab, shape["hidden"], shape["layers"], shape["heads"], shape["kv_heads"],
                           shape["intermediate"], shape["context"])
        config.update(tie_word_embeddings=True, head_dim=shape["hidden"] // shape["heads"])
        model = TargetModel(TargetConfig.from_hf_dict(config, "demo target"))
        init_weights(model, seed=a.seed)
    model.to(a.device)
    sampler = WindowSampler(data, seq_len=a.target_seq_len + 1, seed=a.seed)
    opts = TrainOptions(steps=100_000_000, batch_size=a.target_batch_size, lr=a.target_lr, warmup=0.03,
                        weight_decay=0.1, bf16=a.device.startswith("cuda"), eval_every=a.eval_every, eval_windows=16,
                        save_every=a.eval_every, checkpoint=work / "target.pt", resume=True,
                        time_budget_s=a.target_minutes * 60, device=a.device)
    recipe = LanguageModelRecipe(model)
    with torch.no_grad():
        before = recipe.evaluate(sampler.held_out(16))["loss"] if a.grow_from else None
    result = train(recipe, sampler, opts, label="target")
    dtype = getattr(torch, a.save_dtype)
    model.to(dtype).float()  # what the shipped file holds, so the samples and the drafters see the shipped target
    save_target(model, config, tok, out / "target", dtype)
    grown = {}
    if a.grow_from:  # the block drafters beside the grown target read their old layers at the new indices
        grown = {"grown_from": str(a.grow_from), "layer_map": mapping, "held_out_before": round(before, 4),
                 "retapped": {k: retap_drafter(Path(a.grow_from).parent / k, out / k, mapping) for k in BLOCK_DRAFTERS
                              if (Path(a.grow_from).parent / k / "config.json").is_file()}}
        print(f"target: grown from {a.grow_from}; drafters retapped: {grown['retapped']}; an MTP head trained on "
              "the old target needs `--stage mtp` again", file=sys.stderr)
    return grown | {
        "files_found": len(files), "documents": data.documents, "characters": data.characters,
        "train_tokens": int(data.train.numel()), "held_out_tokens": int(data.held_out.numel()), "vocab": vocab,
        "parameters": sum(p.numel() for p in model.parameters()), "shape": shape, "steps": result.steps,
        "batch": [a.target_batch_size, a.target_seq_len], "lr": a.target_lr,
        "trained_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "tokens_seen": result.steps * opts.batch_size * a.target_seq_len, "train_seconds": round(result.elapsed_s),
        "first_loss": _mean(result.losses[:10]), "last_loss": _mean(result.losses[-10:]),
        "held_out": [(s, round(e["loss"], 4)) for s, e in result.evaluations], "samples": samples(model, tok),
        "wall_seconds": round(time.perf_counter() - t0), "python": sys.version.split()[0], "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
    }


def _new_tokenizer(texts: list[str], vocab: int):
    """A byte-level BPE of `vocab - 1` tokens trained on every second file (up to TOKENIZER_TEXT characters), plus
    the DFlash mask token."""
    sample, chars = [], 0
    for t in texts[::2]:
        sample.append(t)
        chars += len(t)
        if chars >= TOKENIZER_TEXT:
            break
    tok = train_tokenizer(vocab - 1, sample)
    tok.add_special_tokens([MASK])
    return tok


def _mean(losses: list[tuple[int, float]]) -> float:
    return round(sum(v for _, v in losses) / max(1, len(losses)), 4)


def drafter_args(kind: str, a, out: Path, work: Path) -> list[str]:
    """The `draftflow train` command line of one drafter stage."""
    args = [kind, "--target", str(out / "target"), "--out", str(out / kind), "--checkpoint", str(work / f"{kind}.pt"),
            "--resume", "--time-budget-min", str(a.drafter_minutes), "--steps", "10000000", "--seed", str(a.seed),
            "--max-data-mb", str(a.drafter_data_mb), "--summary", str(work / f"{kind}-train.json"), "--device",
            a.device, "--seq-len", str(a.drafter_seq_len), "--batch-size", str(a.batch_size), "--eval-every", str(a.eval_every),
            "--save-every", str(a.eval_every), "--eval-windows", str(a.eval_windows), "--eval-decode-tokens",
            str(a.eval_decode_tokens), "--overwrite"]
    if kind == "mtp":
        return args + ["--labels", "target", "--lr", "3e-3", "--mtp-layout", a.mtp_layout]
    # blocks need the target's own chain as labels (docs/TRAINING.md)
    args += ["--labels", "regenerate", "--regen-windows", str(a.regen_windows), "--anchors", str(a.anchors), "--gguf",
             str(work / f"{kind}.gguf")]
    if a.regen_body_share:
        args += ["--regen-body-share", str(a.regen_body_share)]
    if kind == "dflash" and a.continue_dflash:  # a copy: --init-from may not be the --out it overwrites
        if not (out / "dflash" / "config.json").is_file():
            raise SystemExit(f"error: --continue-dflash: no DFlash drafter in {out / 'dflash'}; train one first "
                             "(--stage dflash without --continue-dflash)")
        start = work / "dflash-start"
        shutil.rmtree(start, ignore_errors=True)
        shutil.copytree(out / "dflash", start)
        return args + ["--lr", str(a.dflash_lr), "--init-from", str(start)]
    if kind == "dflash":
        config = out / "target" / "config.json"  # no target: train says so
        taps = spread_taps(json.loads(config.read_text())["num_hidden_layers"]) if config.is_file() else ()
        return args + ["--lr", str(a.dflash_lr), "--layers", str(DRAFTER_SHAPE["layers"]), "--block-size",
                       str(DRAFTER_SHAPE["block_size"])] + (["--tap-layers", ",".join(map(str, taps))] if taps else [])
    return args + ["--lr", "1e-3", "--init-from", str(out / "dflash"), "--selector-rank", "64", "--selector-top-k", "16",
                   "--conv-kernel-size", "2", "--conv-group-size", "16"]


def spread_taps(depth: int) -> tuple[int, ...]:
    """Three taps from layer 1 on, evenly apart, the last two layers before the end: 1,4,7 of 9; 1,5,9 of 11."""
    step = max(1, (depth - 3) // 2)
    return tuple(min(depth - 1, 1 + i * step) for i in range(3))


def make_drafter(kind: str, a, out: Path, work: Path) -> dict:
    from draftflow.tools.train.cli import main as train_main

    code = train_main(drafter_args(kind, a, out, work))
    if code:
        raise SystemExit(code)
    store_as(out / kind, getattr(torch, a.save_dtype))
    return json.loads((work / f"{kind}-train.json").read_text())


def store_as(folder: Path, dtype: torch.dtype) -> None:
    """Rewrite every safetensors file of `folder` with its floating tensors in `dtype`."""
    for f in folder.glob("*.safetensors"):
        state = {n: t.to(dtype) if t.is_floating_point() else t for n, t in load_file(str(f)).items()}
        save_file(state, str(f), metadata={"format": "pt"})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m draftflow.tools.make_demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "graphs" / "models" / "demo"))
    p.add_argument("--work", default="/tmp/draftflow-demo", help="checkpoints and the run summaries")
    p.add_argument("--stage", choices=("all", *STAGES), default="all")
    p.add_argument("--device", default="cpu", help="cpu or cuda: where every stage trains")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    p.add_argument("--eval-every", type=int, default=200, help="steps between held-out evaluations and checkpoints")
    p.add_argument("--eval-windows", type=int, default=16, help="drafters: held-out windows per evaluation")
    p.add_argument("--eval-decode-tokens", type=int, default=128, help="drafters: tokens the final evaluation decodes "
                   "per held-out window (tau_decode, as bench_humaneval measures; train's --eval-decode-tokens)")
    t = p.add_argument_group("target")
    t.add_argument("--target-minutes", type=float, default=11.0)
    t.add_argument("--data-mb", type=float, default=8.0, help="Python source text to read (the GPU run used 300)")
    t.add_argument("--target-batch-size", type=int, default=8)
    t.add_argument("--target-seq-len", type=int, default=256, help="training window (the GPU run used 1024)")
    t.add_argument("--target-lr", type=float, default=2e-3)
    t.add_argument("--target-layers", type=int, default=TARGET_SHAPE["layers"], help="decoder layers")
    t.add_argument("--grow-from", metavar="TARGET_DIR", help="start from this trained target (its tokenizer and "
                   "weights), grown to --target-layers by inserting identity layers; the DFlash/DFlash2 drafters "
                   "beside it are copied to OUT with their taps moved to the grown target's layers")
    t.add_argument("--grow-train", choices=("all", "new"), default="all", help="with --grow-from: train every "
                   "layer, or only the inserted ones (the trained layers, embeddings, norm and head frozen, so the "
                   "drafters' taps on layers before the first inserted one see exactly what they were trained on)")
    d = p.add_argument_group("drafters")
    d.add_argument("--drafter-minutes", type=float, default=7.0)
    d.add_argument("--drafter-data-mb", type=float, default=32.0)
    d.add_argument("--batch-size", type=int, default=8, help="drafter batch size (the GPU run used 64)")
    d.add_argument("--drafter-seq-len", type=int, default=256, help="drafter training window in tokens (the shipped "
                   "drafters: 256)")
    d.add_argument("--regen-windows", type=int, default=32768, help="regenerated windows for the block drafters")
    d.add_argument("--regen-body-share", type=float, default=0.5, help="block drafters: the share of regenerated "
                   "windows whose prompt ends where a body starts (train's --regen-body-share; the shipped DFlash's "
                   "fourth run used 0.5: HumanEval tau 2.73 -> 2.83, docs/TRAINING.md)")
    d.add_argument("--anchors", type=int, default=64, help="block drafters: blocks per training window (the "
                   "shipped drafters' continued runs used 64; their first DFlash run 16)")
    d.add_argument("--dflash-lr", type=float, default=3e-3)
    d.add_argument("--continue-dflash", action="store_true", help="dflash: continue training the drafter already in "
                   "OUT/dflash under a new schedule (new regenerated windows with another --seed)")
    d.add_argument("--mtp-layout", choices=MTP_LAYOUTS, default=DEMO_MTP_LAYOUT, help="mtp: train's "
                   "--mtp-layout (qwen3-next, the default here, shares the target's LM head: a 3.7 MB file instead "
                   "of 10.0, which the 11-layer target's 40.9 MB needs to stay under 64 MB; docs/TRAINING.md)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    out, work = Path(a.out), Path(a.work)
    created = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    for stage in STAGES:
        if a.stage in ("all", stage):
            try:
                result = make_target(a, out, work) if stage == "target" else make_drafter(stage, a, out, work)
            except DraftflowError as exc:  # e.g. a drafter argument `draftflow train` refuses: its one line
                print(f"error: {exc}", file=sys.stderr)
                if created and not any(work.iterdir()):  # an argument error leaves no empty folder behind
                    work.rmdir()
                return 1
            (work / f"{stage}.json").write_text(json.dumps(result, indent=2) + "\n")
    summary = {s: json.loads((work / f"{s}.json").read_text()) for s in STAGES if (work / f"{s}.json").exists()}
    (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({s: {k: v for k, v in r.items() if k not in ("evaluations", "held_out", "samples")}
                      for s, r in summary.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
