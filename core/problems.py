"""A Problem is one finding of the static checks: where, which node, which rule, and the fix."""

from __future__ import annotations

import attrs


@attrs.frozen(order=True)
class Problem:
    """One line of a check report. Sorted by node, then rule, then message."""

    node: str  # "" for graph-level problems
    rule: str
    message: str
    fix: str
    plugin: str = ""
    where: str = attrs.field(default="", order=False)

    def render(self, source: str = "") -> str:
        """One line; ``where`` is left out when it is just ``source`` (the report's heading names it)."""
        who = f"node '{self.node}'" if self.node else "graph"
        if self.plugin:
            who += f" ({self.plugin})"
        prefix = f"{self.where}: " if self.where and self.where != source else ""
        # An empty fix: the message carries its own (a plugin's DraftflowError ends with the fix).
        fix = f"; fix: {self.fix}" if self.fix else ""
        return f"{prefix}{who} [{self.rule}]: {self.message}{fix}"
