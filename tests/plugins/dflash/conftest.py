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


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models are dominated by thread hand-off; one thread is faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
