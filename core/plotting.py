"""Image outputs (`check --draw`, `trace summarize --plot`): checked before any work, written atomically.

matplotlib is optional (the `plot` extra), so it is imported here and only when an image is asked for.
"""

from __future__ import annotations

import os
from pathlib import Path

from draftflow.core.errors import DraftflowError

INSTALL_HINT = "pip install 'draftflow[plot]' (or pip install matplotlib)"


def pyplot(flag: str):
    """matplotlib.pyplot on the non-interactive Agg backend; a one-line error naming the install if it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise DraftflowError(f"{flag} needs matplotlib, which is not installed ({exc}); {INSTALL_HINT}") from None
    return plt


def image_formats(flag: str) -> tuple[str, ...]:
    """The file extensions the Agg backend writes (png, svg, pdf, ...), without the dot."""
    pyplot(flag)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    return tuple(sorted(FigureCanvasAgg.get_supported_filetypes()))


def check_image_output(path: str | Path, flag: str, inputs: tuple = ()) -> Path:
    """Refuse an image path that cannot be written, before the command does any work.

    matplotlib must import, the extension must be one it writes (none would silently become `.png`
    beside the name the user gave), the folder must exist, and the image must not replace an input.
    """
    path = Path(path)
    formats = image_formats(flag)
    listed = ", ".join("." + f for f in formats)
    ext = path.suffix.lower().lstrip(".")
    if not ext:
        raise DraftflowError(f"{flag} {path}: no image extension; name the file e.g. {path}.png (supported: {listed})")
    if ext not in formats:
        raise DraftflowError(f"{flag} {path}: unknown image extension '.{ext}'; use one of {listed}")
    parent = path.parent
    if not parent.is_dir():
        raise DraftflowError(f"{flag} {path}: the folder {parent} does not exist; create it or pick another path")
    if path.is_dir():
        raise DraftflowError(f"{flag} {path}: is a folder; give an image file name inside it, e.g. {path / ('plot.' + ext)}")
    for given in inputs:
        if path.exists() and Path(given).exists() and os.path.samefile(path, given):
            raise DraftflowError(f"{flag} {path}: is the input file {given}; write the image to another file")
    if not os.access(parent, os.W_OK):
        raise DraftflowError(f"{flag} {path}: the folder {parent} is not writable; pick another path")
    return path


def save_figure(fig, path: str | Path, flag: str) -> None:
    """Write `fig` to a temporary file beside `path`, then rename it over `path`: no half-written image."""
    path = Path(path)
    ext = path.suffix.lower().lstrip(".")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.{ext}")  # matplotlib creates it with the usual mode
    try:
        fig.savefig(tmp, format=ext, dpi=120)
        os.replace(tmp, path)
    except OSError as exc:
        raise DraftflowError(f"{flag} {path}: cannot write the image ({exc.strerror or exc})") from None
    finally:
        tmp.unlink(missing_ok=True)
