"""The files of the user's modules that a session's ranks imported, as the kernel watches them for
``%autoreload``: one ``stat`` per file per cell in the kernel, not one per file on every rank.

Each rank says, with each cell's answer, which module files it newly imported or reloaded and their
mtimes then (:func:`nbdist.worker.autoreload.take_report`). Before a session cell with autoreload on,
the kernel stats each file once and sends the ranks the ones whose mtime is not what every rank
imported; a rank reloads those of its modules, and looks at nothing else. Four ranks and 200 modules
cost the kernel 200 stats instead of 800 spread over ranks that contend for the same cores.

A rank on another machine sees other files: a cell with such a rank leaves each rank to stat its own
(:attr:`~nbdist.protocol.session_channel.Autoreload.changed` None). Standard library only.
"""

from __future__ import annotations

import os
import threading

__all__ = ["WatchedFiles"]


class WatchedFiles:
    """``path -> mtime`` every rank imported it at (None where ranks differ: always sent as changed).

    Examples
    --------
    >>> files = WatchedFiles()
    >>> files.note(0, [("/home/me/model.py", 1)]); files.note(1, [("/home/me/model.py", 1)])
    >>> files.changed()  # the file's mtime on disk is newer: both ranks reload it
    (('/home/me/model.py', 1733400000000000000),)
    """

    def __init__(self):
        self._lock = threading.Lock()  # reports come on the reply reader, the check on the cell's thread
        self._agreed: dict[str, int | None] = {}
        self._by_rank: dict[str, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self._agreed)

    def note(self, rank: int, reported) -> None:
        """Rank ``rank`` imported (or reloaded) these ``(path, mtime_ns)`` files."""
        with self._lock:
            for path, mtime in reported:
                ranks = self._by_rank.setdefault(path, {})
                ranks[rank] = mtime
                self._agreed[path] = mtime if len(set(ranks.values())) == 1 else None

    def changed(self) -> tuple:
        """``((path, mtime_ns now), ...)`` of the files whose mtime on disk is not the one the ranks
        have (a file gone is nobody's to reload)."""
        with self._lock:
            items = list(self._agreed.items())
        out = []
        stat = os.stat
        for path, mtime in items:  # the whole cost of a cell's check: one stat each
            try:
                now = stat(path).st_mtime_ns
            except OSError:
                continue
            if now != mtime:
                out.append((path, now))
        return tuple(out)
