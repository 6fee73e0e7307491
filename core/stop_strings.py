"""Stop strings: committed token ids -> text deltas, cut at the first stop string."""

from __future__ import annotations


class StopScanner:
    """Turns committed token ids into text deltas, holding back what a stop string may still claim.

    After every cycle the whole output is decoded again (byte-level BPE decoding is
    prefix-stable except for an unfinished UTF-8 character, shown as U+FFFD and held back).
    The earliest occurrence of any stop string ends the text just before it; a tail that is
    a prefix of some stop string is held back until it is decided.
    """

    def __init__(self, decode, stop: tuple[str, ...] = ()):
        self.decode, self.stop = decode, tuple(stop)
        self.longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already handed out

    def feed(self, ids) -> tuple[str, bool]:
        """Add committed ids; return (text safe to send now, whether a stop string was hit)."""
        self.ids.extend(ids)
        text = self.decode(self.ids)
        if self.stop:
            start = max(0, self.sent - self.longest + 1)
            hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
            if hits:
                end = max(min(hits), self.sent)
                delta, self.sent = text[self.sent:end], end
                return delta, True
        safe = len(text.rstrip("\ufffd"))
        for k in range(min(self.longest - 1, safe - self.sent), 0, -1):
            if any(s.startswith(text[safe - k:safe]) for s in self.stop):
                safe -= k
                break
        delta, self.sent = text[self.sent:safe], max(safe, self.sent)
        return delta, False

    def flush(self) -> str:
        """Everything not yet sent (the request ended without a stop string)."""
        text = self.decode(self.ids)
        delta, self.sent = text[self.sent:], len(text)
        return delta
