"""Makes `stat_utils` importable from the verifier tests under any pytest import mode."""

import sys
from pathlib import Path

# tests/ has no __init__.py files, so helper modules are found through sys.path; the
# default "prepend" import mode adds this folder already, "importlib" mode does not.
_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
