"""The server's waiting line: one FIFO lane per client key, served round-robin across lanes.

Fairness is between clients, not requests: a client with 100 waiting requests and a client
with 1 alternate instead of queueing in order, and within one client requests keep their
arrival order. A request leaves the line only when the worker has a slot for it, so
``max_waiting`` counts requests that wait, never those being generated.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Any


class QueueFull(Exception):
    """Raised by ``FairQueue.put`` when ``max_waiting`` requests are already waiting (HTTP 503)."""


class FairQueue:
    """Waiting requests, one FIFO lane per client key, served round-robin across lanes.

    ``get`` takes the head of the first lane and moves that lane to the back, so a client
    with 100 waiting requests and a client with 1 alternate instead of queueing in order.
    """

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self._lanes: OrderedDict[str, deque] = OrderedDict()
        self._size = 0
        self._cv = threading.Condition()

    def __len__(self) -> int:
        return self._size

    def put(self, req: Any) -> None:
        with self._cv:
            if self._size >= self.max_waiting:
                raise QueueFull(f"{self._size} requests are waiting (the limit is {self.max_waiting}); retry later")
            self._lanes.setdefault(req.client, deque()).append(req)
            self._size += 1
            self._cv.notify()

    def get(self, timeout: float) -> Any | None:
        with self._cv:
            if not self._cv.wait_for(lambda: self._size > 0, timeout):
                return None
            key, lane = self._lanes.popitem(last=False)
            req = lane.popleft()
            if lane:
                self._lanes[key] = lane  # back of the rotation
            self._size -= 1
            return req

    def remove(self, req: Any) -> bool:
        """Take a waiting request out (its client went away); False if it is not waiting."""
        with self._cv:
            lane = self._lanes.get(req.client)
            if lane is None or req not in lane:
                return False
            lane.remove(req)
            if not lane:
                del self._lanes[req.client]
            self._size -= 1
            return True

    def drain(self) -> list[Any]:
        with self._cv:
            out = [r for lane in self._lanes.values() for r in lane]
            self._lanes.clear()
            self._size = 0
            return out
