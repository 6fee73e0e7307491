"""Paths and small helpers shared by tests (import as `from helpers import ...`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"


def run_cli(args, env=None, cwd=None) -> subprocess.CompletedProcess:
    """Run `python -m draftflow ARGS` and return the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "draftflow", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)
