"""Reading the small files of a checkpoint (config.json and the like) with one-line errors naming the file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from draftflow.core.errors import ModelFormatError


def read_json_object(file: Path, what: str = "a JSON object") -> dict[str, Any]:
    """Parse `file`, which must hold a JSON object; every failure is a ModelFormatError naming the file."""
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:  # a directory, a broken symlink, no permission
        raise ModelFormatError(f"{file}: cannot be read: {file_problem(file) or exc.strerror or exc}; expected {what}; "
                               "check the path and its permissions") from exc
    except UnicodeDecodeError as exc:
        raise ModelFormatError(f"{file}: not UTF-8 text ({exc.reason}); expected {what}; fix or re-download it") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ModelFormatError(f"{file}: invalid JSON ({exc}); expected {what}; fix or re-download it") from exc
    if not isinstance(data, dict):
        raise ModelFormatError(f"{file}: holds a JSON {type(data).__name__}; expected {what}; fix or re-download it")
    return data


def file_problem(file: Path) -> str | None:
    """Why `file` cannot be read as a regular file ('a directory', 'a broken symbolic link', ...), or None."""
    try:
        st = file.stat()
    except FileNotFoundError:
        return f"a broken symbolic link (to {os.readlink(file)})" if file.is_symlink() else "missing"
    except OSError as exc:
        return exc.strerror or str(exc)
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if not os.access(file, os.R_OK):
        return "permission denied"
    return None


def open_safetensors(file: Path, device: str = "cpu") -> Any:
    """``safetensors.safe_open`` on `file`, every failure a ModelFormatError naming the file and the fix."""
    from safetensors import safe_open

    problem = file_problem(file)
    if problem:
        raise ModelFormatError(f"{file}: cannot be read: {problem}; expected a safetensors file; "
                               "check the path and its permissions")
    try:
        return safe_open(str(file), framework="pt", device=str(device))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for bad headers and bytes
        raise ModelFormatError(f"{file}: not a readable safetensors file ({exc}); it is truncated or corrupt, "
                               "re-download or re-save it") from exc
