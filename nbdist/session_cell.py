"""One cell in a session: a run of its own, on ranks that already exist.

The cell's lifecycle is the *cell* level of the design: it ends finished, failed (some rank
raised; the ranks are idle again, their namespaces kept) or interrupted (the stop button; idle
again, state kept). It ends "lost" only when the session itself was lost under it (a rank died,
or could not be brought back). :class:`CellHandle` is what ``Session.run(..., join=False)``
returns; the session fills it from the ranks' replies.
"""

from __future__ import annotations

import threading
import time

from .errors import RankFailure, RunStoppedError, SessionLostError, WorkerFailedError, format_rank_set

__all__ = ["CellHandle", "CELL_TERMINAL"]

CELL_TERMINAL = ("finished", "failed", "interrupted", "lost")


class CellHandle:
    """A cell (or function) running on some ranks of a session.

    Attributes
    ----------
    cell_id : int
        The cell's number in its session.
    ranks : list of int
        The ranks it runs on (the others stay idle).
    status : str
        "running", "finished", "failed", "interrupted" or "lost".
    results : dict
        rank -> value of the ranks that finished so far.
    cell_dir : str
        The cell's record: its payload (and source, for ``execute``).

    Examples
    --------
    >>> cell = session.run(train_epoch, join=False)
    >>> cell.done
    False
    >>> cell.interrupt()      # back to idle, the model and optimizer kept
    """

    def __init__(self, session, cell_id: int, ranks: list[int], cell_dir: str):
        self.session = session
        self.cell_id = cell_id
        self.ranks = list(ranks)
        self.cell_dir = cell_dir
        self.status = "running"
        self.results: dict[int, object] = {}
        self.failures: dict[int, RankFailure] = {}
        self.interrupted: set[int] = set()
        self.offsets: dict[int, tuple] = {}  # rank -> ((stdout, stderr) at start, (stdout, stderr) at end)
        self.error: BaseException | None = None
        self.checked = False  # the session checked that its ranks are still in step after it
        self.started = time.monotonic()
        self.ended: float | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<nbdist.CellHandle {self.cell_id} {self.status} ranks={format_rank_set(self.ranks)}>"

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def busy_ranks(self) -> list[int]:
        """Targeted ranks that have not answered yet."""
        answered = set(self.results) | set(self.failures) | self.interrupted
        return [r for r in self.ranks if r not in answered]

    # ---- filled in by the session --------------------------------------------------------
    def record_start(self, rank: int, offsets) -> None:
        self.offsets[rank] = (tuple(offsets), None)

    def record_done(self, rank: int, kind: str, body, offsets, pid: int | None) -> bool:
        """One rank's answer; True when it was the last one."""
        from .session_rank import load_value

        with self._lock:
            start = self.offsets.get(rank, (None, None))[0]
            self.offsets[rank] = (start, tuple(offsets))
            if kind == "finished":
                self.results[rank] = load_value(body)
            elif kind == "interrupted":
                self.interrupted.add(rank)
            else:
                self.failures[rank] = _failure_from(rank, pid, body)
            return not self.busy_ranks()

    def finish(self) -> None:
        """Every targeted rank answered: settle the cell's status and error."""
        with self._lock:
            if self.done:
                return
            results = dict(sorted(self.results.items()))
            if self.failures:
                self.status = "failed"
                self.error = WorkerFailedError(self.failures, results, self.cell_dir)
            elif self.interrupted:
                self.status = "interrupted"
                self.error = RunStoppedError("interrupted", results, self.cell_dir,
                                             f"{format_rank_set(self.ranks)} idle again, their state kept")
            else:
                self.status = "finished"
            self._end()

    def lose(self, error: SessionLostError, replace: bool = False) -> None:
        """The session went down under this cell. A rank that raised first is still the root cause:
        the error names it (with its cell lines), and says that the session was stopped.
        ``replace``: the cell had ended, and what it ended with turned out to cost the session."""
        with self._lock:
            if self.done and not replace:
                return
            if self.failures:
                error = WorkerFailedError(self.failures, dict(sorted(self.results.items())), self.cell_dir,
                                          error.reason)
                error.session_lost = True
            self.status, self.error = "lost", error
            self._end()

    def _end(self) -> None:
        self.ended = time.monotonic()
        self._done.set()

    # ---- what users call -----------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> dict:
        """Block until every targeted rank answered; return ``{rank: value}`` or raise the cell's error.

        KeyboardInterrupt while waiting interrupts the cell (the ranks go back to idle, their
        state kept), then propagates. ``timeout`` only limits this wait.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._done.wait(0.1):
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"cell {self.cell_id} still running after {timeout} s")
        except KeyboardInterrupt:
            self.interrupt()
            raise
        self.session.check_in_step(self)
        if self.error is not None:
            raise self.error
        return dict(sorted(self.results.items()))

    def interrupt(self) -> None:
        """Raise KeyboardInterrupt in the user code of every busy rank; wait until they are idle.

        A rank that can't be brought back within a few seconds (stuck in C code) is dumped and
        the session is stopped, whole tree; the cell then says which rank was stuck.
        """
        self.session.interrupt_cell(self)


def _failure_from(rank: int, pid, info: dict) -> RankFailure:
    return RankFailure(rank=rank, pid=pid, exitcode=None, traceback=info.get("traceback"),
                       user_traceback=info.get("user_traceback"), exc_type=info.get("exc_type"),
                       message=info.get("message"), hint=info.get("hint"), time=info.get("time", time.time()),
                       secondary=info.get("secondary", False))
