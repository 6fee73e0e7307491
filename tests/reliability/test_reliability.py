"""Every case of the bad-input table (cases_*.py beside this file) through the real CLI."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Case, run_case  # noqa: E402


def _all_cases() -> list[Case]:
    cases = []
    for mod in sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.name.startswith("cases_")):
        cases.extend(importlib.import_module(mod).CASES)
    return cases


CASES = _all_cases()


def test_case_ids_are_unique():
    """Every case has its own id, so a failure names one input."""
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, tmp_path):
    """The case exits as documented, with one clear line, no traceback, no hang, inputs unchanged."""
    run_case(case, tmp_path)
