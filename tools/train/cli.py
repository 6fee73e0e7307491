"""`draftflow train dflash|mtp`: train a drafter against a frozen target.

    draftflow train dflash --target TARGET --out DRAFTER_DIR [--gguf DRAFTER.gguf] [--steps 2000]
    draftflow train mtp    --target TARGET --out MTP_DIR

TARGET is any model the target node loads (Hugging Face directory or .gguf); its
features are computed on the fly from text (`--data` files or folders; default: the
Python sources of this machine, tests excluded). The output loads in the `dflash` node
(`params.path`) or the `mtp` node (`params.path`). Every `--eval-every` steps a held-out
acceptance estimate is printed (tau and acceptance of one greedy draft cycle per held-out
window, through each node's own inference code). `--resume` continues from `--checkpoint`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from draftflow.core.errors import DraftflowError

MASK_NAMES = ("<|mask|>", "<|MASK|>", "<mask>", "[MASK]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftflow train", description="Train a drafter against a frozen target.")
    p.add_argument("recipe", choices=("dflash", "dflash2", "mtp"))
    p.add_argument("--target", required=True, help="frozen target: Hugging Face directory or .gguf file")
    p.add_argument("--out", required=True, help="output directory (Hugging Face layout)")
    p.add_argument("--data", nargs="*", default=None, help="text files or folders (.py, .txt, .md); default: this "
                   "machine's Python sources, tests excluded")
    p.add_argument("--max-data-mb", type=float, default=16.0, help="read at most this much text")
    p.add_argument("--labels", choices=("data", "target"), default="data",
                   help="data: the text's next tokens; target: the target's greedy predictions (distillation)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--time-budget-min", type=float, help="end the run (and its LR schedule) after this many minutes")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=float, default=0.04, help="share of the run spent warming the LR up")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--checkpoint", help="training state file (default: OUT/checkpoint.pt)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    p.add_argument("--summary", help="also write the run's numbers to this JSON file")
    d = p.add_argument_group("dflash")
    d.add_argument("--layers", type=int, default=2, help="draft layers")
    d.add_argument("--block-size", type=int, default=8, help="B: anchor + B-1 drafts")
    d.add_argument("--anchors", type=int, default=16, help="random anchors (blocks) per sequence")
    d.add_argument("--gamma", type=float, help="loss decay exp(-(k-1)/gamma); default 7/5/4 for B 16/10/8")
    d.add_argument("--tap-layers", help="target layers to read, e.g. 1,2,3 (default: z-lab's rule, or 1..L-1 for L < 8)")
    d.add_argument("--mask-token-id", type=int, help=f"default: the tokenizer's {' / '.join(MASK_NAMES[:2])} token")
    d.add_argument("--intermediate", type=int, help="draft MLP width (default: the target's)")
    d.add_argument("--gguf", help="also write the drafter as a GGUF file (llama.cpp names)")
    m = p.add_argument_group("mtp")
    m.add_argument("--num-draft", type=int, default=4, help="chained drafts per cycle for the held-out estimate")
    return p


def _load_target(path: str, device: str):
    from draftflow.plugins.target.plugin import is_gguf

    if not Path(path).exists():
        raise DraftflowError(f"--target {path}: no such model directory or file; pass a Hugging Face directory or .gguf")
    if is_gguf(path):
        from draftflow.plugins.target.gguf_loader import load_gguf as load
    else:
        from draftflow.plugins.target.hf_loader import load_hf as load
    loaded = load(path, device, torch.float32)
    if loaded.tokenizer is None:
        raise DraftflowError(f"--target {path}: the target has no tokenizer; training reads text, so it needs one")
    loaded.model.eval().requires_grad_(False)
    return loaded


def _tap_layers(text: str | None, num_target: int, num_draft: int) -> tuple[int, ...]:
    from draftflow.plugins.dflash.config import default_target_layer_ids

    if text:
        try:
            taps = tuple(int(t) for t in text.split(","))
        except ValueError:
            raise DraftflowError(f"--tap-layers {text!r}: expected comma-separated layer numbers like 1,2,3") from None
    else:
        taps = default_target_layer_ids(num_target, num_draft) if num_target >= 8 else tuple(range(1, num_target))
    bad = [t for t in taps if not 0 <= t < num_target]
    if bad or not taps:
        raise DraftflowError(f"--tap-layers {list(taps)}: layers must lie in [0, {num_target}); pick existing layers")
    return taps


def _mask_id(a, tokenizer, vocab: int) -> int:
    if a.mask_token_id is not None:
        mask = a.mask_token_id
    else:
        found = [tokenizer.token_to_id(n) for n in MASK_NAMES if tokenizer.token_to_id(n) is not None]
        if not found:
            raise DraftflowError("the target's tokenizer has no mask token (" + ", ".join(MASK_NAMES) + "); pass "
                                 "--mask-token-id ID with a token the target never needs to emit")
        mask = found[0]
    if not 0 <= mask < vocab:
        raise DraftflowError(f"--mask-token-id {mask} is outside the target's vocabulary of {vocab}")
    return mask


def main(argv: list[str] | None = None) -> int:
    from draftflow.tools.train.data import TokenData, WindowSampler, read_texts, source_files, tokenizer_encoder
    from draftflow.tools.train.loop import TrainOptions, init_weights, train

    a = build_parser().parse_args(argv)
    if a.recipe == "dflash2":
        raise DraftflowError("train dflash2 is not available yet: the DFlash2 model is still being written; "
                             "train a DFlash drafter with `draftflow train dflash` for now")
    torch.manual_seed(a.seed)
    out = Path(a.out)
    loaded = _load_target(a.target, a.device)
    target, tcfg = loaded.model, loaded.config
    roots = [Path(d) for d in a.data] if a.data else None
    if roots and not all(r.exists() for r in roots):
        raise DraftflowError(f"--data: {', '.join(str(r) for r in roots if not r.exists())} does not exist")
    files = source_files(roots, suffixes=(".py", ".txt", ".md") if roots else (".py",))
    texts = read_texts(files, int(a.max_data_mb * 1e6), seed=a.seed)
    if not texts:
        raise DraftflowError("no training text found; pass --data with .py, .txt or .md files")
    eos = loaded.eos_ids[0] if loaded.eos_ids else 0
    data = TokenData.from_texts(texts, tokenizer_encoder(loaded.tokenizer), eos_id=eos, seed=a.seed)
    sampler = WindowSampler(data, a.seq_len, seed=a.seed)

    if a.recipe == "dflash":
        from draftflow.plugins.dflash.model import DFlashModel
        from draftflow.tools.train.dflash_recipe import DFlashRecipe, new_config

        cfg = new_config(target, a.layers, a.block_size, _tap_layers(a.tap_layers, tcfg.num_layers, a.layers),
                         _mask_id(a, loaded.tokenizer, tcfg.vocab_size), a.intermediate)
        drafter = DFlashModel(cfg, device=a.device)
        init_weights(drafter, seed=a.seed)
        recipe = DFlashRecipe(target, drafter, a.anchors, a.gamma, a.labels, a.seed)
    else:
        from draftflow.tools.train.mtp_recipe import MtpRecipe, new_head

        recipe = MtpRecipe(target, new_head(target, a.seed), a.labels, a.num_draft)
    bf16 = a.precision == "bf16" or (a.precision == "auto" and torch.device(a.device).type == "cuda")
    opts = TrainOptions(steps=a.steps, batch_size=a.batch_size, lr=a.lr, warmup=a.warmup, weight_decay=a.weight_decay,
                        clip=a.clip, bf16=bf16, eval_every=a.eval_every, eval_windows=a.eval_windows,
                        save_every=a.save_every, checkpoint=Path(a.checkpoint) if a.checkpoint else out / "checkpoint.pt",
                        resume=a.resume, time_budget_s=a.time_budget_min * 60 if a.time_budget_min else None,
                        device=a.device)
    trainable = sum(p.numel() for p in recipe.module.parameters() if p.requires_grad)
    print(f"train {a.recipe}: {trainable / 1e6:.2f} M parameters, {data.train.numel()} training tokens from "
          f"{data.documents} documents, target {a.target}", file=sys.stderr)
    t0 = time.perf_counter()
    result = train(recipe, sampler, opts, label=a.recipe)
    if a.recipe == "mtp":
        recipe.save(out, json.loads((Path(a.target) / "config.json").read_text()) if Path(a.target).is_dir()
                    else _config_dict(tcfg))
    else:
        recipe.save(out)
        if a.gguf:
            from draftflow.tools.convert_dflash import hf_to_gguf

            hf_to_gguf(out, a.gguf)
    final = result.evaluations[-1][1]
    print(f"wrote {out}: step {result.steps}, held-out " + ", ".join(f"{k} {v:.3f}" for k, v in final.items()))
    if a.summary:
        losses = result.losses
        Path(a.summary).write_text(json.dumps({
            "recipe": a.recipe, "argv": list(argv or sys.argv[1:]), "parameters": trainable, "steps": result.steps,
            "resumed_from": result.start_step, "train_seconds": round(result.elapsed_s),
            "wall_seconds": round(time.perf_counter() - t0), "train_tokens": int(data.train.numel()),
            "first_loss": round(sum(v for _, v in losses[:10]) / max(1, len(losses[:10])), 4),
            "last_loss": round(sum(v for _, v in losses[-10:]) / max(1, len(losses[-10:])), 4),
            "evaluations": result.evaluations}, indent=2) + "\n")
    return 0


def _config_dict(cfg) -> dict:
    """A Hugging Face config for a GGUF target (the MTP node reads the block's sizes from it)."""
    from draftflow.tools.tiny_model import hf_config

    d = hf_config(cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                  cfg.intermediate_size, cfg.max_position_embeddings)
    d.update(head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
             tie_word_embeddings=cfg.tie_word_embeddings, model_type=cfg.arch,
             architectures=[{"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[cfg.arch]])
    return d


if __name__ == "__main__":
    sys.exit(main())
