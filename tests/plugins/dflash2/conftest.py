"""Makes the dflash2, dflash and verifier test helpers importable; one torch thread for tiny models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# tests/ has no __init__.py files: helper modules are found through sys.path. The dflash2
# helpers build on dflash's (tiny reference drafters, targets) and the verifier's stat_utils.
_PLUGINS = Path(__file__).resolve().parent.parent
for folder in ("dflash2", "dflash", "verifier"):
    if str(_PLUGINS / folder) not in sys.path:
        sys.path.insert(0, str(_PLUGINS / folder))


@pytest.fixture(autouse=True, scope="session")
def _one_thread_dflash2():
    """Tiny models are dominated by thread hand-off; one thread is faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
