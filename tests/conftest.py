"""Shared fixtures: the toy plugins registered next to the built-ins."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import toy_plugins  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # The GPU kernels' tests run on CPU tensors through Triton's interpreter. It must be on before anything first
    # imports triton.language (transformers' model modules do), else Triton's builtins are compiled-mode functions.
    os.environ.setdefault("TRITON_INTERPRET", "1")
from helpers import TESTS  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny test models are dominated by thread hand-off; one intra-op thread is ~3x faster."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _structlog_defaults():
    """A test that configures logging in process (the load-test tool, a served graph) filters INFO events: put
    structlog back afterwards, so a later test's capture_logs sees the cycle events."""
    import structlog

    yield
    structlog.reset_defaults()


@pytest.fixture
def registry():
    """Built-in plugins plus the toy target/drafter."""
    from draftflow.core.registry import load_registry

    return load_registry(extra_plugins=(("toy_plugins", toy_plugins),))


@pytest.fixture
def toy_env():
    """Environment for a `draftflow` subprocess that sees the toy plugins."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH", "")]))
    env["DRAFTFLOW_PLUGINS"] = "toy_plugins"
    return env
