"""Mixer tests share the tiny targets and MTP heads of tests/plugins/mtp/draft_models.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mtp"))

from draft_models import build_target, mimic_mtp, save_mtp, save_target  # noqa: E402


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory):
    """(target dir, MTP dir): a cyclic one-layer qwen3 and a DeepSeek-V3-layout head that re-runs it."""
    root = tmp_path_factory.mktemp("mixer")
    model = build_target("qwen3", 1, cycle=7, layer_scale=3.0)
    target = save_target(model, root / "target")
    return target, save_mtp(mimic_mtp(model, "deepseek-v3"), target, root / "mtp")
