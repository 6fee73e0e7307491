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


def spread_weights(model, gen) -> None:
    """Random weights with unit-scale activations, drawn from `gen`: norm gains 1 + 0.2 N(0, 1), every matrix
    N(0, 1 / fan_in), so greedy argmaxes are not near ties. The generator is left advanced for further draws."""
    import torch

    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
