"""Fixtures for the target tests; the model builders live in target_testlib."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from target_testlib import build_hf_model, save_hf_model


@pytest.fixture
def hf_dir(tmp_path: Path):
    """Factory: build a tiny random HF model, save it, return (hf_model, directory)."""

    def make(arch: str = "qwen3", **kwargs: Any):
        shard = kwargs.pop("max_shard_size", None)
        model = build_hf_model(arch, **kwargs)
        extra = {"max_shard_size": shard} if shard else {}
        return model, save_hf_model(model, tmp_path / f"{arch}-hf", **extra)

    return make
