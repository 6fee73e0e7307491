"""Paths and small helpers shared by tests (import as `from helpers import ...`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# The small trained pair (1M-parameter target + DFlash, DFlash2, MTP; tests/data/demo_small/README.md): the mechanics
# tests run on it; the shipped demo (graphs/models/demo, 17M parameters) only where the test is about the demo.
SMALL_PAIR = TESTS / "data" / "demo_small"
FIXTURES = TESTS / "fixtures"


def run_cli(args, env=None, cwd=None) -> subprocess.CompletedProcess:
    """Run `python -m draftflow ARGS` and return the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "draftflow", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)
