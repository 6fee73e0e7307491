"""Fixtures for MTP tests: tiny targets and standalone MTP heads on disk."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from draft_models import build_target, mimic_mtp, random_mtp, save_mtp, save_target  # noqa: E402


@pytest.fixture(scope="module")
def mimic_dirs(tmp_path_factory):
    """Factory: (target dir, MTP dir) for a cyclic one-layer target and an MTP head that re-runs it."""
    root = tmp_path_factory.mktemp("mtp-mimic")
    model = build_target("qwen3", 1, cycle=7, layer_scale=3.0)
    target = save_target(model, root / "target")

    def make(layout: str) -> tuple[Path, Path]:
        return target, save_mtp(mimic_mtp(model, layout), target, root / layout)

    return make


@pytest.fixture(scope="module")
def random_dirs(tmp_path_factory):
    """Factory: (hf model, target dir, MTP dir) with a random 2-layer target and random MTP weights."""
    root = tmp_path_factory.mktemp("mtp-random")

    def make(layout: str, arch: str = "qwen3"):
        model = build_target(arch, 2, seed=4)
        target = save_target(model, root / f"{arch}-target")
        state = random_mtp(model.config, layout)
        return model, target, save_mtp(state, target, root / f"{arch}-{layout}"), state

    return make
