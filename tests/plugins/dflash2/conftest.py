"""Makes the dflash2, dflash and verifier test helpers importable."""

from __future__ import annotations

import sys
from pathlib import Path


# tests/ has no __init__.py files: helper modules are found through sys.path. The dflash2
# helpers build on dflash's (tiny reference drafters, targets) and the verifier's stat_utils.
_PLUGINS = Path(__file__).resolve().parent.parent
for folder in ("dflash2", "dflash", "verifier"):
    if str(_PLUGINS / folder) not in sys.path:
        sys.path.insert(0, str(_PLUGINS / folder))
