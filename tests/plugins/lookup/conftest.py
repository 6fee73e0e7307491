"""Lookup tests share the tiny targets of tests/plugins/mtp/draft_models.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mtp"))

from draft_models import build_target, save_target  # noqa: E402


@pytest.fixture(scope="module")
def cyclic_target(tmp_path_factory):
    """A one-layer qwen3 whose greedy text mostly repeats with period 7, saved with save_pretrained."""
    return save_target(build_target("qwen3", 1, cycle=7, layer_scale=3.0), tmp_path_factory.mktemp("lookup") / "target")
