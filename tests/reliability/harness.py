"""The bad-input table: each case runs the real `draftflow` CLI in its own process.

A case names the command line, the files it needs (written into a fresh folder first),
and what the user must see: the exit code and a regex the one error line must match.
The runner also pins what every case must do whatever its input: finish within its time
bound (no hang), print no traceback, print exactly one `error: ...` line for a user error,
and leave every input file byte-for-byte unchanged unless the case names it as an output.

Placeholders in argv and file contents: ``{tmp}`` (the case's folder), ``{demo}`` (the
small trained pair of tests/data/demo_small, with its demo.yaml), ``{graphs}`` (the shipped graphs folder), ``{fixtures}``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import attrs

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
GRAPHS = ROOT / "graphs"
DEMO = TESTS / "data" / "demo_small"  # the small trained pair and its graphs (its README.md)


@attrs.frozen
class Case:
    """One bad or odd input and the behaviour it must get."""

    id: str
    argv: tuple[str, ...] = attrs.field(converter=tuple)
    message: str = ""  # regex searched in stderr (exit != 0) or stdout (exit 0)
    exit: int = 1
    files: dict = attrs.field(factory=dict)  # relative name -> str | bytes, written into {tmp} first
    setup: Callable[[Path], None] | None = None  # extra preparation of {tmp}
    outputs: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # files in {tmp} the command may write
    check: Callable[[subprocess.CompletedProcess, Path], None] | None = None  # extra assertions
    toy: bool = False  # see the toy plugins of tests/toy_plugins.py
    env: dict = attrs.field(factory=dict)
    stdin: str | None = None
    timeout: float = 90.0
    lines: int | None = 1  # most stderr lines for exit 1 (a check report lists problems: more); None = no limit


def _subst(text: str, tmp: Path) -> str:
    return (text.replace("{tmp}", str(tmp)).replace("{demo}", str(DEMO)).replace("{graphs}", str(GRAPHS))
            .replace("{fixtures}", str(FIXTURES)))


def _digest(path: Path) -> dict[str, str]:
    """sha256 of every file under path (or of path itself)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def copy_demo(tmp: Path, name: str = "target") -> Path:
    """A writable copy of one shipped demo model folder at {tmp}/NAME."""
    dest = tmp / name
    shutil.copytree(DEMO / name, dest)
    return dest


def env_for(case: Case) -> dict:
    env = dict(os.environ)
    env.pop("DRAFTFLOW_PLUGINS", None)
    env["PYTHONUNBUFFERED"] = "1"
    if case.toy:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH", "")]))
        env["DRAFTFLOW_PLUGINS"] = "toy_plugins"
    env.update(case.env)
    return env


def run_case(case: Case, tmp: Path) -> subprocess.CompletedProcess:
    """Run one case and assert the rules every case shares, then its own."""
    for name, content in case.files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(_subst(content, tmp))
    if case.setup is not None:
        case.setup(tmp)
    argv = [_subst(a, tmp) for a in case.argv]
    outputs = {str(tmp / o) for o in case.outputs}
    watched = {**_digest(tmp), **_digest(FIXTURES), **_digest(GRAPHS)}
    start = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "draftflow", *argv], capture_output=True, text=True, cwd=tmp,
                           env=env_for(case), timeout=case.timeout, input=case.stdin)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{case.id}: no answer within {case.timeout:.0f} s (a hang)") from None
    took = time.monotonic() - start
    out = r.stdout + r.stderr
    assert "Traceback" not in out, f"{case.id}: traceback\n{r.stderr[-3000:]}"
    assert r.returncode == case.exit, f"{case.id}: exit {r.returncode}, expected {case.exit} ({took:.1f} s)\n{r.stderr[-3000:]}"
    if case.exit == 1:
        assert r.stderr.startswith("error: ") and r.stderr.endswith("\n"), \
            f"{case.id}: a user error must start 'error: ...', got\n{r.stderr[-3000:]}"
        assert case.lines is None or r.stderr.count("\n") <= case.lines, \
            f"{case.id}: a user error must be at most {case.lines} line(s), got\n{r.stderr[-3000:]}"
    elif case.exit == 2:  # argparse usage errors: the usage lines, then 'draftflow ...: error: ...'
        assert r.stderr.rstrip().splitlines()[-1].split(": error: ", 1)[-1], r.stderr
    if case.message:
        where = r.stderr if case.exit else r.stdout + r.stderr
        assert re.search(case.message, where), f"{case.id}: /{case.message}/ not in\n{where[-3000:]}"
    after = {**_digest(tmp), **_digest(FIXTURES), **_digest(GRAPHS)}
    changed = sorted(p for p, h in watched.items() if after.get(p) != h and p not in outputs)
    assert not changed, f"{case.id}: input files changed or removed: {changed}"
    if case.check is not None:
        case.check(r, tmp)
    return r
