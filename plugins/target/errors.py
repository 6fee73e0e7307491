"""Errors raised by the target-model runtime.

Each message is one line: the file, the tensor or field, what was expected, what was
found, and how to fix it, so a user can act without reading a traceback.
`ModelFormatError` is the engine's own class, re-exported so that the CLI's handler and
`pytest.raises` see one class whichever module a caller imports it from.
"""

from __future__ import annotations

from draftflow.core.errors import DraftflowError, ModelFormatError

__all__ = ["CacheCapacityError", "ModelFormatError"]


class CacheCapacityError(DraftflowError):
    """Raised when a KV-cache write or reservation would pass the cache's capacity."""
