"""Fixtures for the dflash tests (helpers live in dflash_testlib)."""

from __future__ import annotations

import pytest
import torch
from dflash_testlib import build_reference, save_reference


@pytest.fixture
def drafter_dir(tmp_path):
    """Factory: (reference model, saved HF directory)."""

    def make(name: str = "drafter", dtype: torch.dtype = torch.float32, **kw):
        model = build_reference(**kw)
        return model, save_reference(model, tmp_path / name, dtype)

    return make
