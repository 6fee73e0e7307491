"""Where `draftflow train` writes: never into an input, never over files it did not write, never half a file.

`check_outputs` runs before any work. The drafter folder (`--out`) may be new, empty, or a previous output of the
same recipe (its config.json, weights, checkpoint and the run's own named outputs); anything else needs
`--overwrite`, which replaces the recipe's files there and keeps the rest. No flag allows writing into the
target, the `--init-from` drafter or the data. Files are written under a temporary name and renamed into place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from draftflow.core.errors import DraftflowError
from draftflow.tools.train.checks import KIND_NAMES, model_kind

ARTIFACTS = {"dflash": ("model.safetensors", "config.json"), "dflash2": ("model.safetensors", "config.json"),
             "mtp": ("mtp.safetensors", "config.json")}  # written in this order: config.json last
CHECKPOINT = "checkpoint.pt"


def _real(path) -> Path:
    return Path(os.path.realpath(path))


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _is_temp(name: str) -> bool:
    return name.startswith(".") and ".tmp-" in name


def checkpoint_path(a) -> Path:
    return Path(a.checkpoint) if a.checkpoint else Path(a.out) / CHECKPOINT


def regen_cache_path(a) -> Path:
    """Where `--labels regenerate` keeps its pool of regenerated windows: beside the checkpoint."""
    checkpoint = checkpoint_path(a)
    return checkpoint.with_name(checkpoint.name + ".regen.pt")


def check_outputs(a, data_files: list[Path]) -> None:
    """Refuse, before training, any output that would overwrite an input or a folder the user did not make for us."""
    out = _real(a.out)
    models = [("--target", a.target)] + ([("--init-from", a.init_from)] if a.init_from else [])
    if out.exists() and not out.is_dir():
        raise DraftflowError(f"--out {a.out}: is a file; give a folder for the drafter (it gets "
                             f"{' and '.join(ARTIFACTS[a.recipe])})")
    for name, given in models:
        model = _real(given)
        if _within(out, model):
            where = "is" if out == model else "is inside"
            raise DraftflowError(f"--out {a.out}: {where} the {name} folder {given}; the drafter's "
                                 f"{' and '.join(ARTIFACTS[a.recipe])} would replace or mix with its files; pick a new "
                                 f"folder, e.g. {Path(given).name}-{a.recipe}")
    for d in a.data or ():
        if _real(d) == out:
            raise DraftflowError(f"--out {a.out}: is the --data folder {d}; pick a new folder for the drafter")
    outputs = [(f"--out {a.out}", Path(a.out) / n) for n in ARTIFACTS[a.recipe]]
    outputs += [("--checkpoint", checkpoint_path(a))]
    outputs += [(f, Path(v)) for f, v in (("--gguf", a.gguf), ("--summary", a.summary)) if v]
    reads = {_real(f) for f in data_files}
    seen: dict[Path, str] = {}
    for name, path in outputs:
        label = name if name.startswith("--out") else f"{name} {path}"
        real = _real(path)
        for model_flag, given in models:
            model = _real(given)
            if _within(real, model):
                where = "is" if real == model else "lies in"
                kind = "file" if model.is_file() else "folder"
                raise DraftflowError(f"{label}: {path} {where} the {model_flag} {kind} {given}; write it elsewhere")
        if real in reads:
            raise DraftflowError(f"{label}: {path} is a --data file the run reads; write it elsewhere")
        if real.is_dir():
            raise DraftflowError(f"{label}: {path} is a folder; give a file name")
        if real in seen:
            raise DraftflowError(f"{label}: {path} is also the {seen[real]} output; give each output its own file")
        seen[real] = name.split()[0]
        if name in ("--gguf", "--summary") and not real.parent.is_dir() and real.parent != out:
            raise DraftflowError(f"{label}: the folder {path.parent} does not exist; create it first")
    if out.is_dir() and not a.overwrite:
        kept = outputs + [("", regen_cache_path(a))]  # an earlier run's regenerated pool is this run's file too
        _check_previous_output(a, out, {CHECKPOINT} | {p.name for _, p in kept if _real(p).parent == out})


def _check_previous_output(a, out: Path, ours: set[str]) -> None:
    """A non-empty --out must look like an earlier run of this recipe: only its files, its kind of config.json."""
    others = sorted(p.name for p in out.iterdir() if p.name not in ours and not _is_temp(p.name))
    kind = model_kind(out) if (out / "config.json").exists() else a.recipe
    if not others and kind == a.recipe:
        return
    if kind != a.recipe:
        held = f"holds {KIND_NAMES[kind] if kind else 'a config.json that is no drafter config'}, not a {a.recipe} drafter"
    else:
        held = (f"holds files a `train {a.recipe}` run does not write ({', '.join(others[:3])}"
                f"{', ...' if len(others) > 3 else ''})")
    raise DraftflowError(f"--out {a.out}: {held}; pick a new or empty folder, or pass --overwrite to replace "
                         f"{' and '.join(ARTIFACTS[a.recipe])} there (other files are kept)")


def write_files(folder: Path, writers: dict[str, Callable[[Path], None]]) -> None:
    """Write each file under a temporary name in `folder`, then rename them into place in the given order.

    A crash while writing leaves the previous files untouched; the renames themselves are atomic.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    temps: dict[str, Path] = {}
    try:
        for name, write in writers.items():
            temps[name] = folder / f".{name}.tmp-{os.getpid()}"
            write(temps[name])
        for name, tmp in temps.items():
            os.replace(tmp, folder / name)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)


def write_file(path: Path, write: Callable[[Path], None]) -> None:
    """`write_files` for one file: `write(tmp)` fills a temporary file that then replaces `path`."""
    path = Path(path)
    write_files(path.parent, {path.name: write})
