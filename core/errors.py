"""Exception classes: one per kind of failure a user can cause.

Every user-facing error carries a one-line message that names the file, node or field,
what is wrong, and how to fix it. The CLI prints ``error: <message>`` and exits 1;
only bugs in draftflow itself produce a traceback.
"""

from __future__ import annotations


class DraftflowError(Exception):
    """Raised for any problem the user can fix; the CLI prints it without a traceback."""

    exit_code = 1


class SpecError(DraftflowError):
    """Raised when a graph YAML file is malformed, has unknown keys or wrong types."""


class PluginError(DraftflowError):
    """Raised when a plugin cannot be imported, implements an unknown hook, or declares an invalid manifest."""


class CheckError(DraftflowError):
    """Raised when static graph checks find problems; carries every problem at once.

    The message lists the first ``MAX_SHOWN`` problems in sorted order, then one line
    saying how many more there are (a generated graph can have hundreds of thousands).
    """

    MAX_SHOWN = 50

    def __init__(self, problems, graph_name: str = "graph"):
        self.problems = sorted(problems)
        self.graph_name = graph_name
        n = len(self.problems)
        head = f"{n} problem{'s' if n != 1 else ''} in {graph_name}:"
        lines = [head] + ["  " + p.render(graph_name) for p in self.problems[:self.MAX_SHOWN]]
        if n > self.MAX_SHOWN:
            more = n - self.MAX_SHOWN
            lines.append(f"  ... and {more} more problem{'s' if more != 1 else ''} (fix the first ones and check again)")
        super().__init__("\n".join(lines))


class ModelFormatError(DraftflowError):
    """Raised when a checkpoint or its config is missing, corrupt, or disagrees with itself."""


class CacheCapacityError(DraftflowError):
    """Raised when a KV-cache (or recurrent-state) write or reservation would pass its capacity."""


class RequestError(DraftflowError):
    """Raised when a generation request is invalid: prompt past the context, ids outside the vocabulary, bad sampling values."""


class OwnershipError(DraftflowError):
    """Raised in debug mode when a node writes a buffer it does not own."""


class FollowerDone(Exception):
    """Raised by ``Session.open`` on a tensor-parallel rank > 0 once rank 0 closed its session: the rank mirrored
    every call and has nothing left to do (not a failure: the CLI exits 0 on it; core/mirror.py)."""
