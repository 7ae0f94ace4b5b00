"""An incarnation's life as one small state machine: its states, the moves allowed between them, and
the one place that makes each move (:meth:`Life.move`).

Four modules act on an incarnation (bringing it up, recovering a cell, the other kernels of a world,
the incarnation itself), and each once set its ``status`` string directly, in three files, with the
process groups' generation bumped outside the lock it was read under. Now they ask the incarnation's
:class:`Life` for a move. A move the machine does not allow is a bug and raises :class:`IllegalMove`;
a move that lost a race (the session was closed meanwhile) is answered False, and the caller goes on.

States::

    starting    the ranks come up
    idle        every rank waits for a cell
    busy        a cell runs
    recovering  the ranks are being brought in step after a cell that failed or was stopped
                (or, idle, with another node's kernel that stopped its part; or the survivors of a
                death are told which members their groups lack)
    degraded    a rank died; the survivors keep their state and take cells on themselves only
    healing     a replacement rank is being made from its peers
    lost        the ranks can't go on; final, but for closing
    closed      ended by the user; final

What :attr:`Life.public` shows (``Session.status``) keeps today's words: a recovering incarnation is
"busy", a lost one "broken".
"""

from __future__ import annotations

import threading

__all__ = ["STATES", "MOVES", "FINAL", "PUBLIC", "IllegalMove", "Life"]

STATES = ("starting", "idle", "busy", "recovering", "degraded", "healing", "lost", "closed")
MOVES: dict[str, frozenset[str]] = {
    "starting": frozenset({"idle", "lost", "closed"}),
    "idle": frozenset({"busy", "recovering", "degraded", "lost", "closed"}),
    "busy": frozenset({"idle", "recovering", "degraded", "lost", "closed"}),
    "recovering": frozenset({"idle", "degraded", "lost", "closed"}),
    "degraded": frozenset({"busy", "recovering", "healing", "lost", "closed"}),
    "healing": frozenset({"idle", "recovering", "lost", "closed"}),
    "lost": frozenset({"closed"}),
    "closed": frozenset(),
}
FINAL = frozenset({"lost", "closed"})
PUBLIC = {"recovering": "busy", "lost": "broken"}


class IllegalMove(RuntimeError):
    """A move the state machine does not allow: nbdist's own bug, named with both states."""


class Life:
    """One incarnation's state and its process groups' generation, under the incarnation's lock.

    Examples
    --------
    >>> life = Life(threading.RLock())
    >>> life.move("idle")
    True
    >>> life.move("idle", only_from=("busy",))   # not busy: nothing to do
    False
    >>> life.move("starting")
    Traceback (most recent call last):
    IllegalMove: an incarnation can't go from idle to starting
    """

    def __init__(self, lock=None):
        self._lock = lock if lock is not None else threading.RLock()
        self._state = "starting"
        self._generation = 0
        self.moves: list[tuple[str, str]] = []  # (from, to), in order: what tests and bug reports read

    @property
    def state(self) -> str:
        return self._state

    @property
    def public(self) -> str:
        """The state in ``Session.status``'s words."""
        return PUBLIC.get(self._state, self._state)

    @property
    def ended(self) -> bool:
        return self._state in FINAL

    @property
    def generation(self) -> int:
        """Of the ranks' process groups: one more per re-forming."""
        return self._generation

    def move(self, to: str, only_from=None) -> bool:
        """Go to ``to``. With ``only_from``, only from one of those states (False otherwise: another
        thread moved first, which is no error). Raises :class:`IllegalMove` for a move not in MOVES."""
        if to not in MOVES:
            raise IllegalMove(f"no such state: {to!r}")
        with self._lock:
            here = self._state
            if only_from is not None and here not in only_from:
                return False
            if to not in MOVES[here]:
                raise IllegalMove(f"an incarnation can't go from {here} to {to}")
            self._state = to
            self.moves.append((here, to))
            return True

    def end(self, to: str) -> bool:
        """Go to a final state from wherever the incarnation is; False when it already ended there or
        was closed (closing is the one way out of "lost")."""
        with self._lock:
            if self._state == to or self._state == "closed":
                return False
            return self.move(to)

    def next_generation(self) -> int:
        """The generation the ranks re-form to, counted under the lock that readers take."""
        with self._lock:
            self._generation += 1
            return self._generation
