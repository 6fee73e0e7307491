"""`draftflow train` flags checked right after parsing, before torch and the target load.

Each problem is one `DraftflowError` naming the flag, its value, what is wrong and the fix:
numeric ranges, options of another recipe, what the input paths hold, and where the run writes
(`output.check_outputs`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from draftflow.core.errors import DraftflowError

INT_MAX = 2**31 - 1  # no count of steps, rows, layers or tokens here can exceed this
MAX_STEP_TOKENS = 2**24  # --batch-size x --seq-len: a step past 16M tokens fits no device with a target beside it
MAX_POOL_TOKENS = 2**28  # windows x --seq-len held as token ids at once (2 GiB of int64)

# dest: (lowest, lowest allowed itself?, highest, what the flag is). Floats must also be finite.
RANGES = {
    "steps": (1, True, INT_MAX, "optimizer steps"),
    "batch_size": (1, True, INT_MAX, "windows per step"),
    "seq_len": (2, True, INT_MAX, "tokens per window"),
    "max_data_mb": (0.0, False, math.inf, "megabytes of text to read"),
    "time_budget_min": (0.0, False, math.inf, "minutes"),
    "lr": (0.0, False, math.inf, "the peak learning rate, e.g. 6e-4"),
    "warmup": (0.0, True, 1.0, "the share of the run warming up, e.g. 0.04"),
    "weight_decay": (0.0, True, math.inf, "AdamW's weight decay"),
    "clip": (0.0, False, math.inf, "the gradient-norm bound"),
    "seed": (0, True, 2**63 - 1, "the random seed"),
    "eval_every": (0, True, INT_MAX, "steps between evaluations; 0: only at the end"),
    "eval_windows": (0, True, INT_MAX, "held-out windows"),
    "eval_decode_tokens": (0, True, 2**20, "tokens decoded per held-out window; 0: off"),
    "save_every": (0, True, INT_MAX, "steps between checkpoints; 0: only at the end"),
    "regen_windows": (1, True, INT_MAX, "regenerated windows"),
    "regen_temperature": (0.0, True, math.inf, "0 (greedy) or a sampling temperature"),
    "regen_body_share": (0.0, True, 1.0, "the share of regenerated windows whose prompt ends at a body start"),
    "layers": (1, True, INT_MAX, "draft layers"),
    "block_size": (2, True, INT_MAX, "the anchor plus at least one draft"),
    "anchors": (1, True, INT_MAX, "blocks per window"),
    "gamma": (0.0, False, math.inf, "the loss decay"),
    "mask_token_id": (0, True, INT_MAX, "a token id"),
    "intermediate": (1, True, INT_MAX, "the MLP width"),
    "window": (0, True, INT_MAX, "cells a row attends back; 0: full attention"),
    "conv_kernel_size": (1, True, INT_MAX, "taps"),
    "conv_group_size": (1, True, INT_MAX, "channels per coefficient"),
    "selector_rank": (1, True, INT_MAX, "the codebook width"),
    "selector_top_k": (1, True, INT_MAX, "candidates per row"),
    "selector_alpha": (0.0, True, math.inf, "the selector loss weight"),
    "distill": (0.0, True, 1.0, "a weight from 0 to 1"),
    "selector_warmup": (0.0, True, 1.0, "a share of the run"),
    "selector_ramp": (0.0, True, 1.0, "a share of the run"),
    "num_draft": (1, True, INT_MAX, "drafts per cycle"),
}


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_ranges(a) -> None:
    """Every numeric flag inside its range (and finite); the token budgets of a step and of the window pools."""
    for dest, (low, low_ok, high, what) in RANGES.items():
        value = getattr(a, dest, None)
        if value is None:
            continue
        name = f"{flag(dest)} {value}"
        if isinstance(value, float) and not math.isfinite(value):
            raise DraftflowError(f"{name}: not a finite number; give {what}")
        if value < low or (value == low and not low_ok):
            bound = f"at least {low}" if low_ok else f"above {low}"
            raise DraftflowError(f"{name}: must be {bound} ({what})")
        if value > high:
            raise DraftflowError(f"{name}: must be at most {high} ({what})")
    seq = a.seq_len
    for dest, count, most in (("batch_size", a.batch_size, MAX_STEP_TOKENS),
                              ("eval_windows", a.eval_windows, MAX_POOL_TOKENS),
                              ("regen_windows", a.regen_windows if a.labels == "regenerate" else None,
                               MAX_POOL_TOKENS)):
        if count is not None and count * seq > most:
            raise DraftflowError(f"{flag(dest)} {count} x --seq-len {seq} is {count * seq} tokens, more than {most} at "
                                 f"once; lower {flag(dest)} or --seq-len")


def check_recipe_options(a, owners: dict[str, tuple[str, ...]]) -> None:
    """An option of another recipe (or of --labels regenerate) is a mistake, not something to ignore.

    `owners`: dest -> the recipes it applies to; these flags parse to None unless given.
    """
    for dest, recipes in owners.items():
        if getattr(a, dest) is None:
            continue
        if dest in ("prompt_len", "regen_windows", "regen_temperature", "regen_body_share"):
            if a.labels != "regenerate":
                raise DraftflowError(f"{flag(dest)} applies to --labels regenerate only (this run has --labels "
                                     f"{a.labels}); drop it or add --labels regenerate")
        elif a.recipe not in recipes:
            raise DraftflowError(f"{flag(dest)} is an option of {' and '.join(recipes)}, not of {a.recipe}; drop it "
                                 f"(see draftflow train {a.recipe} --help)")


def model_kind(path: Path) -> str | None:
    """What a model path holds, from its files alone: 'gguf', 'dflash', 'dflash2', 'mtp', 'target', or None."""
    if path.is_file():
        with path.open("rb") as f:
            return "gguf" if f.read(4) == b"GGUF" else None
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    archs = config.get("architectures") or []
    if "DFlash2DraftModel" in archs:
        return "dflash2"
    if "DFlashDraftModel" in archs or "dflash_config" in config:
        return "dflash"
    if (path / "mtp.safetensors").exists() and not any(path.glob("model*.safetensors")):
        return "mtp"
    return "target"


KIND_NAMES = {"dflash": "a DFlash drafter", "dflash2": "a DFlash2 drafter", "mtp": "MTP heads (mtp.safetensors)",
              "target": "a target model", None: "not a model"}


def check_models(a) -> None:
    """--target is a model (not a drafter, not text); --init-from is a drafter the recipe can start from."""
    target = Path(a.target)
    if not target.exists():
        raise DraftflowError(f"--target {a.target}: no such model folder or file; pass a Hugging Face folder or .gguf")
    kind = model_kind(target)
    if kind not in ("target", "gguf"):
        what = KIND_NAMES[kind] if kind else ("a file that is not .gguf" if target.is_file() else
                                              "a folder without a readable config.json")
        raise DraftflowError(f"--target {a.target}: {what}; pass the frozen target model (a Hugging Face folder with "
                             "config.json and weights, or a .gguf file)")
    if a.init_from is None:
        return
    init = Path(a.init_from)
    if not init.exists():
        raise DraftflowError(f"--init-from {a.init_from}: no such drafter; pass the --out folder (or .gguf) of "
                             "`draftflow train dflash`")
    kind = model_kind(init)
    takes = ("a DFlash (v1) drafter, the --out of `draftflow train dflash`" if a.recipe == "dflash" else
             "a DFlash or DFlash2 drafter, the --out of `draftflow train dflash` or `dflash2`")
    if kind in ("target", "mtp", None) or (kind == "dflash2" and a.recipe == "dflash"):
        what = KIND_NAMES[kind] if kind else ("a file that is not .gguf" if init.is_file() else
                                              "a folder without a readable config.json")
        raise DraftflowError(f"--init-from {a.init_from}: {what}; --init-from takes {takes}")


def check_data(paths: list[str]) -> list[Path]:
    """The --data paths exist; a file named directly is non-empty UTF-8 text (a folder's files are filtered)."""
    roots = [Path(d) for d in paths]
    for root in roots:
        if not root.exists():
            raise DraftflowError(f"--data {root}: no such file or folder")
        if root.is_file():
            with root.open("rb") as f:
                head = f.read(1 << 16)
            if not head.strip():
                raise DraftflowError(f"--data {root}: the file is empty; pass text files (.py, .txt, .md)")
            if b"\0" in head or _bad_utf8(head):
                raise DraftflowError(f"--data {root}: not UTF-8 text (binary content); pass text files (.py, .txt, "
                                     ".md)")
    return roots


def _bad_utf8(head: bytes) -> bool:
    import codecs

    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at 64 KiB is fine
    except UnicodeDecodeError:
        return True
    return False


def check_device(text: str) -> str:
    """`cpu`, `cuda` or `cuda:N` that this torch can use."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise DraftflowError(f"--device {text}: not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        from draftflow.core.plan import device_problem  # one rule for graphs and training

        problem = device_problem(text)
        if problem is not None:
            raise DraftflowError(f"--device {text}: {problem[0]}; {problem[1]}")
    elif device.type != "cpu":
        raise DraftflowError(f"--device {text}: training runs on cpu or cuda; use one of those")
    return text
