"""The default torch threads on the CPU (`session.default_threads`): 1 for a small target, counted as float32, so a
bfloat16 graph of the 17M demo target (34 MB) gets the physical cores as its float32 graph (68 MB) does."""

from __future__ import annotations

import pytest
from helpers import ROOT

from draftflow.core import session as session_module
from draftflow.core.session import SMALL_TARGET_BYTES, Session, default_threads, physical_cores


def test_small_means_few_weights_not_few_bytes():
    half = SMALL_TARGET_BYTES // 2 + 1  # bytes of a 16-bit target just over the float32 threshold's weight count
    assert default_threads("cpu", half, itemsize=2) == physical_cores()
    assert default_threads("cpu", half, itemsize=4) == 1
    assert default_threads("cpu", SMALL_TARGET_BYTES // 4, itemsize=2) == 1
    assert default_threads("cuda", 1, itemsize=2) == physical_cores()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_demo_target_gets_the_cores_in_either_dtype(monkeypatch, dtype):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(session_module, "physical_cores", lambda: 2)  # a 2-core machine, whatever this one has
    s = Session.open(ROOT / "graphs" / "demo.yaml", overrides=[f"dtype={dtype}"])
    try:
        assert s.threads == 2
    finally:
        s.close()
