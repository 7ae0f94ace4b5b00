"""Rich output held in the kernel, bounded per rank as lines are: the newest bundles stay, the
oldest go, and how many went is counted so that a view can say so.

A rank can display faster than anyone can look (a figure per step, an HTML table in a tight loop):
without a bound the kernel keeps every bundle of a cell for its life and a view draws a backlog that
grows while it draws, which is how a stop came to wait minutes behind a flood of displays. The same
structure bounds the cell's record (what a late view replays) and a view's queue between two draws.
"""

from __future__ import annotations

import collections
import itertools
import json
from dataclasses import dataclass, field

from nbdist.run.events import DisplayEvent

__all__ = ["DisplayBacklog", "TakenDisplays", "bundle_size", "RECORD_DISPLAYS", "RECORD_BYTES", "DRAW_BYTES"]

RECORD_DISPLAYS = 100  # per rank, in a cell's record (replayed to late views) and shown in a rank's tab
RECORD_BYTES = 50 * 2**20  # per rank, in a cell's record
# Per rank, what a view draws at once (it draws ~10 times a second): a flood reaches the notebook at a
# rate a browser survives, and a draw, which a stop waits for, stays short.
DRAW_BYTES = 8 * 2**20


def bundle_size(event: DisplayEvent) -> int:
    """About how many bytes a MIME bundle holds (its encoded values: a PNG's base64, an HTML string)."""
    size = 0
    for value in event.data.values():
        if isinstance(value, (str, bytes)):
            size += len(value)
        else:  # application/json and the like: rare, and their size is what they encode to
            size += len(json.dumps(value, default=str))
    return size


@dataclass
class TakenDisplays:
    """What a backlog held: its bundles in the order they came, and per rank how many were dropped."""

    events: list[DisplayEvent] = field(default_factory=list)
    dropped: dict[int, int] = field(default_factory=dict)

    def dropped_note(self, rank: int, where: str) -> str | None:
        """One line for rank ``rank``'s dropped bundles (None when none was), ``where`` saying why."""
        n = self.dropped.get(rank, 0)
        if not n:
            return None
        return f"[nbdist: {n:,} display{'s' if n != 1 else ''} of rank {rank} not shown here, {where}]"


class DisplayBacklog:
    """Per rank, the last ``max_count`` bundles within ``max_bytes``; the oldest dropped and counted.

    Not thread-safe by itself: its owner holds its lock around every call.

    Examples
    --------
    >>> backlog = DisplayBacklog(max_count=2, max_bytes=2**20)
    >>> for i in range(3):
    ...     backlog.add(DisplayEvent(0, {"text/plain": str(i)}))
    >>> taken = backlog.take()
    >>> [e.data["text/plain"] for e in taken.events], taken.dropped
    (['1', '2'], {0: 1})
    """

    def __init__(self, max_count: int = RECORD_DISPLAYS, max_bytes: int = RECORD_BYTES):
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._by_rank: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._bytes: collections.Counter = collections.Counter()
        self._dropped: collections.Counter = collections.Counter()
        self._order = itertools.count()  # bundles of different ranks come back in the order they came

    def __len__(self) -> int:
        return sum(len(q) for q in self._by_rank.values())

    def add(self, event: DisplayEvent) -> None:
        """Keep ``event``; drop the rank's oldest bundles while it holds too many or too much.

        A single bundle larger than ``max_bytes`` is kept alone (the newest is always shown).
        """
        queue, size = self._by_rank[event.rank], bundle_size(event)
        queue.append((next(self._order), event, size))
        self._bytes[event.rank] += size
        while len(queue) > 1 and (len(queue) > self.max_count or self._bytes[event.rank] > self.max_bytes):
            _, _, old = queue.popleft()
            self._bytes[event.rank] -= old
            self._dropped[event.rank] += 1

    def ranks(self) -> set[int]:
        """The ranks it holds (or dropped) bundles of."""
        return {r for r, q in self._by_rank.items() if q} | {r for r, n in self._dropped.items() if n}

    def snapshot(self) -> TakenDisplays:
        """What it holds (it keeps it): for a view that subscribes late."""
        return TakenDisplays(self._merged(), {r: n for r, n in self._dropped.items() if n})

    def take(self) -> TakenDisplays:
        """What it holds, emptied: for a view's next draw."""
        taken = self.snapshot()
        self._by_rank.clear()
        self._bytes.clear()
        self._dropped.clear()
        return taken

    def _merged(self) -> list[DisplayEvent]:
        items = [item for queue in self._by_rank.values() for item in queue]
        return [event for _, event, _ in sorted(items, key=lambda item: item[0])]
