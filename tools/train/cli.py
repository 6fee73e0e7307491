"""`draftflow train dflash|dflash2|mtp`: train a drafter against a frozen target.

    draftflow train dflash  --target TARGET --out DRAFTER_DIR [--gguf DRAFTER.gguf] [--steps 2000]
    draftflow train dflash2 --target TARGET --out DRAFTER_DIR [--init-from DFLASH_OR_DFLASH2_DIR] [--selector-top-k 16]
    draftflow train mtp     --target TARGET --out MTP_DIR

TARGET is any model the target node loads (Hugging Face directory or .gguf); its
features are computed on the fly from text (`--data` files or folders; default: the
Python sources of this machine, tests excluded). The output loads in the `dflash`,
`dflash2` or `mtp` node (`params.path`). Every `--eval-every` steps a held-out acceptance
estimate is printed (tau and acceptance of one greedy draft cycle per held-out window,
through each node's own inference code; for DFlash2 both with the learned selector and,
as `*_top1`, with the top-1 ablation). `--resume` continues from `--checkpoint`.

Every flag is checked before torch and the target load (`checks.py`). `--out` is a new or empty folder or an
earlier output of the same recipe (else `--overwrite`), never the target, `--init-from` or `--data`; files are
written under temporary names and renamed into place (`output.py`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from draftflow.core.errors import DraftflowError
from draftflow.tools.train.build import MASK_NAMES, build_recipe

BLOCKS, DFLASH2, MTP, REGEN = ("dflash", "dflash2"), ("dflash2",), ("mtp",), ("dflash", "dflash2", "mtp")
# Passes over the regenerated pool past which `train` prints a note: the demo's 3-layer DFlash at 4.9 passes ended with
# held-out loss 1.90 (training 1.67), at 13.1 passes 2.85 (training 1.28); 2-layer runs at 2.3 passes held 1.60-1.67
# (docs/TRAINING.md, "Growing a drafter")
POOL_PASSES = 4
# Options of some recipes only (or of --labels regenerate): they parse to None unless given, so an option of
# another recipe is refused rather than ignored; these are their defaults.
RECIPE_DEFAULTS = {"regen_windows": 16384, "regen_temperature": 0.0, "regen_body_share": 0.0, "anchors": 16, "conv_kernel_size": 2,
                   "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16, "selector_alpha": 1.0,
                   "selector_warmup": 0.0005, "selector_ramp": 0.0005, "selector_stop_gradient": False, "num_draft": 4,
                   "distill": 0.0, "mtp_layout": "deepseek-v3"}


def build_parser() -> argparse.ArgumentParser:
    """The train parser; `parser.recipe_only` maps each recipe-specific dest to the recipes it applies to."""
    p = argparse.ArgumentParser(prog="draftflow train", description="Train a drafter against a frozen target.")
    owners: dict[str, tuple[str, ...]] = {}

    def only(group, recipes, *flags, **kw):
        action = group.add_argument(*flags, **kw, default=None)
        owners[action.dest] = recipes

    p.add_argument("recipe", choices=("dflash", "dflash2", "mtp"))
    p.add_argument("--target", required=True, help="frozen target: Hugging Face directory or .gguf file")
    p.add_argument("--out", required=True, help="output directory (Hugging Face layout); new, empty, or an earlier "
                   "output of the same recipe (see --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out that is not an earlier "
                   "output of this recipe, replacing its config.json and weights (other files are kept); never "
                   "allowed for the target, --init-from or --data")
    p.add_argument("--data", nargs="*", default=None, help="text files or folders (.py, .txt, .md); default: this "
                   "machine's Python sources, tests excluded")
    p.add_argument("--max-data-mb", type=float, default=16.0, help="read at most this much text")
    p.add_argument("--labels", choices=("data", "target", "regenerate"), default="data",
                   help="data: the text's next tokens; target: the target's greedy predictions (distillation); "
                   "regenerate: windows whose tail the target wrote greedily (the DFlash paper's recipe)")
    only(p, REGEN, "--prompt-len", help="regenerate: tokens of text that start a window, N or MIN-MAX (drawn per "
         "generation batch); the target writes the rest. Default 16 to the most that leaves --anchors blocks")
    only(p, REGEN, "--regen-windows", type=int, help="regenerate: windows in the generated pool (default 16384)")
    only(p, REGEN, "--regen-temperature", type=float, help="regenerate: 0 (default) = the target writes greedily; T > 0 "
         "= it samples at temperature T (labels for drafting at T > 0)")
    only(p, REGEN, "--regen-body-share", type=float, metavar="SHARE", help="regenerate: this share (0 to 1, default 0) "
         "of the windows start so that their prompt ends where a function or class body starts (after a def/class "
         "line or a docstring), as a HumanEval prompt does; the target writes the body")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--time-budget-min", type=float, help="end the run (and its LR schedule) after this many minutes")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=float, default=0.04, help="share of the run spent warming the LR up")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--eval-decode-tokens", type=int, default=0, metavar="N",
                   help="the final evaluation also decodes N tokens from each held-out window's midpoint, verifying "
                        "as the runtime does at T = 0 with a fixed K, and reports tau_decode (the number "
                        "bench_humaneval measures; the one-cycle tau sees only the first cycle after held-out text); 0: off")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--checkpoint", help="training state file (default: OUT/checkpoint.pt)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    p.add_argument("--summary", help="also write the run's numbers to this JSON file")
    d = p.add_argument_group("dflash and dflash2")
    only(d, BLOCKS, "--layers", type=int, help="draft layers (default 2)")
    only(d, BLOCKS, "--block-size", type=int, help="B: anchor + B-1 drafts (default 8)")
    only(d, BLOCKS, "--anchors", type=int, help="random anchors (blocks) per sequence (default 16)")
    only(d, BLOCKS, "--distill", type=float, metavar="W", help="weight of the KL to the target's own next-token "
         "distribution (temperature 1) in each row's loss, (1 - W) x cross-entropy + W x KL; 0 to 1 (default 0: "
         "labels only). Teaches the drafter how sure the target is, which sampled (T > 0) verification accepts")
    only(d, BLOCKS, "--gamma", type=float, help="loss decay exp(-(k-1)/gamma); default 7/5/4 for B 16/10/8")
    only(d, BLOCKS, "--tap-layers", help="target layers to read, e.g. 1,2,3 (default: z-lab's rule, or 1..L-1 for L < 8)")
    only(d, BLOCKS, "--mask-token-id", type=int, help=f"default: the tokenizer's {' / '.join(MASK_NAMES[:2])} token")
    only(d, BLOCKS, "--intermediate", type=int, help="draft MLP width (default: the target's)")
    only(d, BLOCKS, "--window", type=int, help="W: the drafter's layers attend non-causally over a sliding window of W "
         "cells (the context less than W behind a row, and its block); default --seq-len, the farthest a training "
         "window shows it (a drafter attending further at inference than it was trained to lost its acceptance on "
         "the demo pair, docs/TRAINING.md); 0: full attention. At least --block-size")
    only(d, BLOCKS, "--gguf", help="also write the drafter as a GGUF file (llama.cpp names)")
    only(d, BLOCKS, "--init-from", help="start from this trained drafter (HF directory or .gguf): dflash continues a "
         "DFlash (v1) drafter under a new schedule; dflash2 takes a DFlash drafter as its backbone, or continues a "
         "DFlash2 drafter (convolutions and selector too); its shape replaces --layers, --block-size, --tap-layers, "
         "--mask-token-id, --intermediate (and, from a DFlash2, the dflash2 shape flags). dflash with more --layers "
         "than it has grows it: new layers after its own, starting as identities (output projections zero)")
    s = p.add_argument_group("dflash2")

    only(s, DFLASH2, "--conv-kernel-size", type=int, help="K: taps of the dynamic convolutions (default 2)")
    only(s, DFLASH2, "--conv-group-size", type=int, help="G: channels per dynamic coefficient (divides hidden; "
         "default 16)")
    only(s, DFLASH2, "--selector-rank", type=int, help="R: codebook width (default 256)")
    only(s, DFLASH2, "--selector-top-k", type=int, help="M: candidates per draft row (default 16)")
    only(s, DFLASH2, "--selector-alpha", type=float, help="weight of the selector loss (default 1.0)")
    only(s, DFLASH2, "--selector-warmup", type=float, help="share of the run with selector weight 0 (default 0.0005)")
    only(s, DFLASH2, "--selector-ramp", type=float, help="share of the run ramping the weight to alpha "
         "(default 0.0005)")
    only(s, DFLASH2, "--selector-stop-gradient", action="store_true",
         help="the selector loss trains only the selector (not the unary logits and hidden states)")
    m = p.add_argument_group("mtp")
    only(m, MTP, "--num-draft", type=int, help="chained drafts per cycle for the held-out estimate (default 4)")
    only(m, MTP, "--mtp-layout", choices=("deepseek-v3", "qwen3-next"),  # plugins.mtp.weights.LAYOUTS (no torch here)
         help="deepseek-v3 (default): the head has its own LM head, trained; qwen3-next: it shares the target's LM "
              "head, frozen, and the file is vocab x hidden weights smaller")
    p.recipe_only = owners
    return p


def parse_args(argv: list[str] | None):
    """Parse and check every flag that needs no model: ranges, recipe options, what the paths hold, the outputs.

    Returns (args, the --data files the run reads (none listed yet without --data), those named directly).
    """
    from draftflow.tools.train.checks import check_data, check_models, check_ranges, check_recipe_options
    from draftflow.tools.train.data import source_files
    from draftflow.tools.train.output import check_outputs

    parser = build_parser()
    a = parser.parse_args(argv)
    check_recipe_options(a, parser.recipe_only)
    a.given = {dest for dest in RECIPE_DEFAULTS if getattr(a, dest) is not None}  # --init-from DFlash2 checks these
    for dest, default in RECIPE_DEFAULTS.items():
        if getattr(a, dest) is None:
            setattr(a, dest, default)
    check_ranges(a)
    check_models(a)
    if a.data == []:
        raise DraftflowError("--data needs at least one file or folder; leave the flag out to read this machine's "
                             "Python sources")
    roots = check_data(a.data) if a.data else None
    files = source_files(roots, suffixes=(".py", ".txt", ".md")) if roots else []  # the default roots: later
    if roots and not files:
        raise DraftflowError(f"--data {' '.join(a.data)}: no .py, .txt or .md files there; pass text files or folders "
                             "holding them")
    check_outputs(a, files)
    return a, files, {r.resolve() for r in roots or () if r.is_file()}


def _load_target(path: str, device: str):
    import torch

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


def _check_gguf_target(target: str) -> None:
    """--gguf writes the target's tokenizer keys into the drafter file, as llama.cpp needs: refuse a target that
    cannot supply them (no .gguf tokenizer, no byte-level BPE tokenizer.json) before any training."""
    import gguf

    from draftflow.tools.gguf_tokenizer import copy_target_tokenizer

    try:
        copy_target_tokenizer(gguf.GGUFWriter(None, "dflash"), target)
    except DraftflowError as exc:
        raise DraftflowError(f"--gguf: {exc}; or leave out --gguf and convert later with "
                             "python -m draftflow.tools.convert_dflash DRAFTER_DIR drafter.gguf --target TARGET") from None


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    a, files, named = parse_args(argv)
    from draftflow.tools.train.data import TokenData, WindowSampler, read_texts, source_files, tokenizer_encoder
    from draftflow.tools.train.loop import TrainOptions, train
    from draftflow.tools.train.output import checkpoint_path, write_file

    known = _known_width(a)
    if known:  # before reading and tokenizing the text (seconds to minutes); the built recipe is checked again below
        _check_room(a.seq_len, known)
    texts = read_texts(files or source_files(), int(a.max_data_mb * 1e6), seed=a.seed, named=named)
    if not texts:
        where = " ".join(a.data) if a.data else "this machine's Python sources"
        raise DraftflowError(f"no training text found in {where}; pass --data with .py, .txt or .md files (files "
                             "under 200 bytes or over 200 kB inside folders are skipped)")
    read_s = time.perf_counter() - started
    import torch

    from draftflow.tools.train.checks import check_device

    a.device = check_device(a.device) if a.device else "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(a.seed)
    out = Path(a.out)
    if getattr(a, "gguf", None):
        _check_gguf_target(a.target)  # before training, not after: the drafter file copies the target's tokenizer
    t_load = time.perf_counter()
    loaded = _load_target(a.target, a.device)
    load_s = time.perf_counter() - t_load
    tcfg = loaded.config
    if a.seq_len > tcfg.max_position_embeddings:
        raise DraftflowError(f"--seq-len {a.seq_len}: longer than the target's context of {tcfg.max_position_embeddings} "
                             "tokens; use a shorter window")
    eos = loaded.eos_ids[0] if loaded.eos_ids else 0
    t_tok = time.perf_counter()
    data = TokenData.from_texts(texts, tokenizer_encoder(loaded.tokenizer), eos_id=eos, seed=a.seed)
    tokenize_s = time.perf_counter() - t_tok
    sampler = WindowSampler(data, a.seq_len, seed=a.seed)
    labels = a.labels
    if a.labels == "regenerate":  # labels exact everywhere (MTP) / in the written part (blocks: first_anchor)
        labels = "target" if a.recipe == "mtp" else "data"

    recipe = build_recipe(a, loaded, labels)
    width = recipe.config.block_size if a.recipe != "mtp" else 2
    _check_room(a.seq_len, width)
    if a.labels == "regenerate":
        sampler = _regenerated(a, loaded, sampler, width, a.anchors if a.recipe != "mtp" else 1)
    bf16 = a.precision == "bf16" or (a.precision == "auto" and torch.device(a.device).type == "cuda")
    opts = TrainOptions(steps=a.steps, batch_size=a.batch_size, lr=a.lr, warmup=a.warmup, weight_decay=a.weight_decay,
                        clip=a.clip, bf16=bf16, eval_every=a.eval_every, eval_windows=a.eval_windows,
                        eval_decode_tokens=a.eval_decode_tokens, save_every=a.save_every, checkpoint=checkpoint_path(a),
                        resume=a.resume, time_budget_s=a.time_budget_min * 60 if a.time_budget_min else None,
                        device=a.device)
    trainable = sum(p.numel() for p in recipe.module.parameters() if p.requires_grad)
    setup = {"setup_seconds": round(time.perf_counter() - started, 1), "read_text_seconds": round(read_s, 1),
             "load_target_seconds": round(load_s, 1), "tokenize_seconds": round(tokenize_s, 1)}
    intro = (f"train {a.recipe}: {trainable / 1e6:.2f} M parameters, {data.train.numel()} training tokens from "
             f"{data.documents} documents, target {a.target}; set up in {setup['setup_seconds']} s, labels included (reading the "
             f"text {setup['read_text_seconds']} s, loading the target {setup['load_target_seconds']} s, tokenizing "
             f"{setup['tokenize_seconds']} s)")
    t0 = time.perf_counter()
    try:
        result = train(recipe, sampler, opts, label=a.recipe, intro=intro)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not isinstance(exc, torch.OutOfMemoryError) and not any(m in str(exc) for m in ("out of memory",
                                                                                            "can't allocate memory")):
            raise
        raise DraftflowError(f"out of memory on {a.device} at --batch-size {a.batch_size} x --seq-len {a.seq_len} "
                             f"({str(exc).splitlines()[0][:120]}); lower --batch-size or --seq-len") from None
    if a.recipe == "mtp":
        recipe.save(out, json.loads((Path(a.target) / "config.json").read_text()) if Path(a.target).is_dir()
                    else _config_dict(tcfg))
    else:
        recipe.save(out)
        if a.gguf:
            from draftflow.tools.convert_dflash import hf_to_gguf

            write_file(Path(a.gguf), lambda tmp: hf_to_gguf(out, tmp, target=a.target))
    final = result.evaluations[-1][1]
    print(f"wrote {out}: step {result.steps}, held-out " + ", ".join(f"{k} {v:.3f}" for k, v in final.items()))
    if result.stopped_by:
        print(f"note: {result.stopped_by} ended the run at step {result.steps} of {a.steps}: {out} holds the drafter "
              f"trained so far; the same command with --resume continues the run from {checkpoint_path(a)}",
              file=sys.stderr)
    passes = round(result.steps * a.batch_size / a.regen_windows, 2) if a.labels == "regenerate" else None
    if passes is not None and passes > POOL_PASSES:
        print(f"note: {result.steps} steps of {a.batch_size} windows went over the {a.regen_windows} regenerated "
              f"windows {passes:g} times; past about {POOL_PASSES} the held-out loss rose in the demo's runs "
              f"(docs/TRAINING.md): for a run this long give --regen-windows "
              f"{math.ceil(result.steps * a.batch_size / POOL_PASSES)} or more", file=sys.stderr)
    if a.summary:
        losses = result.losses
        summary = {
            "recipe": a.recipe, "argv": list(argv or sys.argv[1:]), "parameters": trainable, "steps": result.steps,
            "resumed_from": result.start_step, "train_seconds": round(result.elapsed_s),
            "wall_seconds": round(time.perf_counter() - t0), "train_tokens": int(data.train.numel()),
            "first_loss": _mean(v for _, v in losses[:10]), "last_loss": _mean(v for _, v in losses[-10:]),
            "evaluations": result.evaluations, "stopped_by": result.stopped_by, **setup}
        if passes is not None:
            summary["regen_passes"] = passes  # training windows drawn over the regenerated pool's size
        if result.parts:  # e.g. DFlash2: token_loss, selector_loss, recall (means of the first / last 10 steps)
            summary["first_parts"] = {k: _mean(p[k] for _, p in result.parts[:10]) for k in result.parts[0][1]}
            summary["last_parts"] = {k: _mean(p[k] for _, p in result.parts[-10:]) for k in result.parts[0][1]}
        write_file(Path(a.summary), lambda tmp: tmp.write_text(json.dumps(summary, indent=2) + "\n"))
    return 0


def _prompt_range(text: str | None, seq: int, width: int, anchors: int) -> tuple[int, int]:
    """--prompt-len N or MIN-MAX; every window must keep room for a block of `width` after its prompt."""
    most = seq - width + 1  # the last prompt token anchors a block whose rows end the window
    if text is None:
        lo, hi = min(16, most), max(min(16, most), seq - width - anchors + 2)
    else:
        try:
            lo, _, hi = text.partition("-")
            lo, hi = int(lo), int(hi or lo)
        except ValueError:
            raise DraftflowError(f"--prompt-len {text!r}: expected a number like 32 or a range like 16-96") from None
    if not 1 <= lo <= hi:
        raise DraftflowError(f"--prompt-len {text}: give 1 <= MIN <= MAX")
    if hi > most:
        raise DraftflowError(f"--seq-len {seq} leaves no block of {width} after --prompt-len {hi}; use --seq-len of "
                             f"at least {hi + width - 1} or prompts of at most {most} tokens")
    return lo, hi


def _regenerated(a, loaded, sampler, width: int, anchors: int):
    import torch

    from draftflow.tools.train.output import regen_cache_path
    from draftflow.tools.train.regenerate import RegeneratedSampler

    lo, hi = _prompt_range(a.prompt_len, a.seq_len, width, anchors)
    if a.regen_windows < 1:
        raise DraftflowError(f"--regen-windows {a.regen_windows}: give a positive number of windows")
    temperature = a.regen_temperature
    t0 = time.perf_counter()
    # batched greedy generation: a GPU takes thousands of rows per forward, a CPU does best with a few hundred
    rows = 4096 if torch.device(a.device).type == "cuda" else 512
    # kept next to the checkpoint; read back under --resume (the pool a resumed run started on, not paid for twice)
    cache = regen_cache_path(a)
    share = a.regen_body_share
    token_text = [loaded.tokenizer.decode([i]) for i in range(loaded.tokenizer.get_vocab_size())] if share else None
    regen = RegeneratedSampler(sampler, loaded.model, (lo, hi), a.regen_windows, seed=a.seed, batch_size=rows,
                               temperature=temperature, cache=cache, reuse=a.resume, body_share=share,
                               token_text=token_text)
    how = f"sampled at T = {temperature:g}" if temperature > 0 else "written"
    done = f"read back from {cache}" if regen.reused else f"in {time.perf_counter() - t0:.1f} s" + (
        f" (none read back: {regen.cache_note})" if regen.cache_note else "")
    bodies = f"; {share:g} of the prompts end where a body starts" if share else ""
    print(f"regenerated {a.regen_windows} windows of {a.seq_len} tokens ({lo}-{hi} of text, the rest {how} by the "
          f"target{bodies}) {done}", file=sys.stderr)
    return regen


def _mean(values) -> float:
    values = list(values)
    return round(sum(values) / max(1, len(values)), 4)


def _check_room(seq_len: int, width: int) -> None:
    if seq_len < width + 1:  # a block (MTP: the two next tokens) after at least one token of context
        raise DraftflowError(f"--seq-len {seq_len} leaves no room for a block of {width} after the first token; use "
                             f"--seq-len of at least {width + 1}")


def _known_width(a) -> int | None:
    """The rows a training block predicts, when the flags or --init-from's config.json say it without the target."""
    if a.recipe == "mtp":
        return 2
    if not a.init_from:
        return a.block_size or 8
    try:
        return int(json.loads((Path(a.init_from) / "config.json").read_text())["block_size"])
    except (OSError, ValueError, KeyError, TypeError):  # unreadable here: the drafter's loader names the problem later
        return None


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
