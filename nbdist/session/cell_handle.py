"""One cell in a session: a run of its own, on ranks that already exist.

A :class:`CellHandle` answers what a view asks of a :class:`nbdist.run.state.Run` (events, rank
states, status, error, Kill), so ``%%distributed`` shows a session cell with the same views: its
output is the part of each rank's log between the cell's start and its end.

The cell's lifecycle is the *cell* level of the design: it ends finished, failed (some rank
raised; the ranks are idle again, their namespaces kept) or interrupted (the stop button; idle
again, state kept). It ends "lost" only when the session itself was lost under it (a rank died,
or could not be brought back). :class:`CellHandle` is what ``Session.run(..., join=False)``
returns; the session fills it from the ranks' replies.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from nbdist.errors import RankFailure, RunStoppedError, SessionLostError, WorkerFailedError, format_rank_set
from nbdist.run.display_backlog import DisplayBacklog
from nbdist.run.events import DisplayEvent, EventSource, OutputChunk, RankStatus, RunEvent
from nbdist.run.retention import discard_data
from nbdist.session.replica_check import describe_stop_point

__all__ = ["CellHandle", "DebugStop"]


@dataclass(frozen=True)
class DebugStop:
    """A rank stopped in pdb: what pdb printed before it asked, and where the rank stands."""

    rank: int
    text: str
    where: str
    number: int  # this cell's prompts, counted: each is shown once

class CellHandle(EventSource):
    """A cell (or function) running on some ranks of a session.

    A text view prints nothing more for a cell that finished (its output is all there is), as a
    kernel does for a plain cell.

    Attributes
    ----------
    cell_id : int
        The cell's number in its session.
    targets : list of int
        The ranks it runs on (the others stay idle).
    ranks : dict
        rank -> :class:`nbdist.run.events.RankStatus`, as a Run has them (what the views draw).
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

    def __init__(self, incarnation, cell_id: int, ranks: list[int], cell_dir: str, internal: bool = False,
                 stdin: bool = False):
        self.incarnation = incarnation  # the ranks it runs on: only they can be acted on for it
        self.internal = internal  # nbdist's own call (bringing the ranks in step), not a user's cell
        self.cell_id = cell_id
        self.targets = list(ranks)
        self.cell_dir = cell_dir
        self.status = "running"
        self.results: dict[int, object] = {}
        # Each rank's value as it came, where it came through shared memory: a heal hands the donor's
        # on to the new rank without copying it (nbdist.protocol.shared_values.reshare).
        self.shared_replies: dict[int, object] = {}
        self.failures: dict[int, RankFailure] = {}
        self.deaths: set[int] = set()  # ranks that died during the cell (their failure says how)
        self.interrupted: set[int] = set()
        self.restored: dict[int, tuple] = {}  # rank -> torch modes it put back as the cell found them
        self.agreed = None  # the stop point the ranks agreed on (nbdist.session.agreed_stop), if any
        self.stopped_before: dict[int, str] = {}  # rank -> the collective it stopped before (the point)
        self.reached: dict[int, dict] = {}  # rank -> {group: this cell's collectives} (stopped or failed)
        self.models_reset = False  # the session reset its DDP/FSDP2 models' half-done step after it
        self.stopped_anywhere: list[int] = []  # ranks still busy when the stop's window closed: stopped where they were
        self.behind: list[int] = []  # of those, the ones that had not reached the stop point
        self.offsets: dict[int, tuple] = {}  # rank -> ((stdout, stderr) at start, (stdout, stderr) at end)
        self.error: BaseException | None = None
        self.stop_requested = False  # the stop button, a timeout or a peer's failure asked to stop it
        self.released: list[int] = []  # ranks freed from a collective by dropping their peers' connections
        self.release_sent: set[int] = set()  # ranks told to drop their connections
        self.note: str | None = None  # what the session did to bring the ranks in step after this cell
        self.announced = False  # a session across kernels told the other nodes that this cell stopped
        self.stopped_by: str | None = None  # another node's kernel stopped its part first, and why
        self.collectives = ""  # which collective each rank waited in when it was stopped (flight recorders)
        self.stdin = stdin  # a front end answers the ranks' pdb prompts (else a breakpoint goes on)
        self.skipped_breakpoint = False  # said once: a breakpoint with no stdin went on
        self.prompts = 0
        self.paused: dict[int, DebugStop] = {}  # ranks stopped in pdb, waiting for a command
        self.debug_changed = threading.Condition()  # a rank stopped in pdb or went on
        self.started = time.monotonic()
        self.ended: float | None = None
        self.run_id = f"{incarnation.session_id}/{cell_id}"
        self.run_dir = cell_dir
        self.log_dir = incarnation.run_dir  # each rank's log is one file for the whole session
        self.label = f"session {incarnation.session_id} · cell {cell_id}"
        if incarnation.gone and not internal:  # a degraded session's view says which ranks it lacks
            heal = "%dist_heal" if incarnation.from_magics else "heal()"
            self.label += f" · {format_rank_set(sorted(incarnation.gone))} gone ({heal})"
        self.quiet_when_finished = True
        self.nprocs = len(self.targets)
        self.ranks = {r: RankStatus(r, "running", pid=incarnation.pids.get(r)) for r in self.targets}  # as Run.ranks
        self.resumed_text: dict[int, str] = {}  # what pdb printed as a rank went on, for the prompt to show
        self.report: str | None = None
        self._subscribers: list = []
        self._lines = {r: collections.deque(maxlen=5000) for r in self.targets}  # replayed to late views
        self._displays = DisplayBacklog()  # rich output, each rank's last ones (replayed too)
        self.answered = threading.Event()  # every targeted rank replied (the cell is done once in step)
        self._timer: threading.Timer | None = None  # its timeout, cancelled when it ends
        self._done = threading.Event()
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"<nbdist.CellHandle {self.cell_id} {self.status} ranks={format_rank_set(self.targets)}>"

    @property
    def done(self) -> bool:
        return self._done.is_set()

    # ---- what a view asks of a run ----------------------------------------------------------
    def global_rank(self, rank: int) -> int:
        return rank  # a cell's ranks are named by their global rank already

    def subscribe(self, callback, replay: bool = True) -> None:
        """Call ``callback(event)`` for the cell's output chunks and rank states (as Run.subscribe)."""
        with self._lock:
            if replay:
                self._replay(callback, self._lines, self._replayed_displays())
            self._subscribers.append(callback)

    def feed(self, chunk: OutputChunk) -> None:
        """Output of a rank while this cell runs (the session forwards its ranks' log lines)."""
        if chunk.rank not in self._lines or self.done:
            return
        with self._lock:
            self._lines[chunk.rank].extend((chunk.stream, line) for line in chunk.lines)
            self._emit(chunk)

    def feed_display(self, rank: int, data: dict, metadata: dict) -> None:
        """A rank's ``display(...)`` or figure: the views show rank 0's in the notebook, others' in their tab."""
        with self._lock:
            event = DisplayEvent(rank, data, metadata)
            self._displays.add(event)
            self._emit(event)

    @property
    def displays(self) -> list[DisplayEvent]:
        """The rich output the kernel still holds, in order: each rank's last
        :data:`~nbdist.run.display_backlog.RECORD_DISPLAYS` bundles, up to ``RECORD_BYTES``."""
        with self._lock:
            return self._displays.snapshot().events

    def _replayed_displays(self) -> list:
        """For a late view: a line per rank whose oldest displays were dropped, then those kept."""
        held = self._displays.snapshot()
        notes = [OutputChunk(r, "stderr", [held.dropped_note(r, f"the kernel keeps each rank's last "
                                                               f"{self._displays.max_count} or "
                                                               f"{self._displays.max_bytes >> 20} MB")], "")
                 for r in sorted(held.dropped)]
        return [*notes, *held.events]

    def on_debug_message(self, rank: int, message) -> None:
        """A rank's pdb asks for a command (``("debug", rank, cell, text, where)``), or went on. With
        nobody at a stdin (``--bg``, nbconvert, a call from code), the rank is told to go on, and the
        cell's output says so once."""
        if message[0] == "debug_resumed":
            self.debug_resumed(rank, message[3])
            return
        if self.stdin:
            self.debug_stop(rank, message[3], message[4])
            return
        if not self.skipped_breakpoint:
            self.skipped_breakpoint = True
            self.feed(OutputChunk(rank, "stderr", [f"nbdist: rank {rank} reached a breakpoint at {message[4]}; this "
                                                   f"cell has no stdin to debug it from (--bg, a headless run, a call "
                                                   f"from code), so the ranks go on"], ""))
        self.incarnation.send([rank], ("debug_reply", self.cell_id, "continue"))

    def debug_stop(self, rank: int, text: str, where: str) -> None:
        """Rank ``rank`` stopped in pdb at ``where`` (``text``: what pdb printed), waiting for a command."""
        with self.debug_changed:
            self.prompts += 1
            self.paused[rank] = DebugStop(rank, text, where, self.prompts)
            self.debug_changed.notify_all()
        with self._lock:
            st = self.ranks[rank]
            st.status, st.where = "paused", where
            self._emit(RunEvent("paused", rank, st))

    def debug_resumed(self, rank: int, text: str) -> None:
        """Rank ``rank``'s pdb let its code run on (``text``: what pdb printed last)."""
        with self.debug_changed:
            self.paused.pop(rank, None)
            self.resumed_text[rank] = self.resumed_text.get(rank, "") + text
            self.debug_changed.notify_all()
        with self._lock:
            st = self.ranks[rank]
            if st.status == "paused":
                st.status, st.where = "running", None
                self._emit(RunEvent("running", rank, st))

    def _set_rank(self, rank: int, status: str) -> None:
        st = self.ranks[rank]
        st.status, st.ended = status, time.monotonic()
        self._emit(RunEvent(status, rank, st))

    def kill(self):
        """The view's Kill button on a session cell: stop the cell, keep the ranks and their state."""
        self.interrupt()

    def busy_ranks(self) -> list[int]:
        """Targeted ranks that have not answered yet."""
        answered = set(self.results) | set(self.failures) | self.interrupted
        return [r for r in self.targets if r not in answered]

    def start_timer(self, timeout: float, interrupt) -> None:
        """Call ``interrupt(self)`` after ``timeout`` seconds unless the cell ended first."""
        self._timer = threading.Timer(timeout, interrupt, args=(self,))
        self._timer.daemon = True
        self._timer.start()

    # ---- filled in by the session --------------------------------------------------------
    def record_done(self, rank: int, kind: str, body, offsets, pid: int | None) -> bool:
        """One rank's answer; True when it was the last one."""
        from nbdist.protocol.session_channel import load_value
        from nbdist.protocol.shared_values import SharedValue

        with self._lock:
            self.offsets[rank] = tuple(map(tuple, offsets))
            if kind == "finished":
                try:
                    self.results[rank] = load_value(body)
                    if isinstance(body, SharedValue):
                        self.shared_replies[rank] = body
                except Exception as exc:  # a class only the ranks can import, say: this cell's error
                    kind, body = "failed", _unloadable(rank, exc)
            if kind in ("interrupted", "failed") and isinstance(body, dict) and "reached" in body:
                self.reached[rank] = body.pop("reached")  # where an export replays the cell to
            if kind == "interrupted":
                self.interrupted.add(rank)
                if body and body.get("restored"):  # the stop landed where torch restores a mode: put back
                    self.restored[rank] = tuple(body["restored"])
                if body and body.get("stopped_before"):
                    self.stopped_before[rank] = body["stopped_before"]
            elif kind == "failed":
                self.failures[rank] = RankFailure.from_record(rank, pid, body)
            self._set_rank(rank, kind)
            if self.busy_ranks():
                return False
            self.answered.set()
            return True

    def record_death(self, failure: RankFailure) -> bool | None:
        """A rank died before it answered: its part failed as ``failure`` says. None when it had
        answered already (the cell goes on without it); else True when it was the last one."""
        with self._lock:
            if self.done or failure.rank not in self.busy_ranks():
                return None
            self.failures[failure.rank] = failure
            self.deaths.add(failure.rank)
            st = self.ranks[failure.rank]
            st.exitcode, st.signal_name = failure.exitcode, failure.signal_name
            self._set_rank(failure.rank, "failed")
            if self.busy_ranks():
                return False
            self.answered.set()
            return True

    def finish(self) -> None:
        """Every targeted rank answered: settle the cell's status and error."""
        with self._lock:
            if self.done:
                return
            results = dict(sorted(self.results.items()))
            if self.failures:
                self.status = "failed"
                self.error = WorkerFailedError(self.failures, results, self.cell_dir, note=self.note,
                                               elsewhere=self.incarnation.ranks_elsewhere(), remote_cause=self.stopped_by)
                if not self.internal:
                    self.incarnation.last_failed_rank = self.error.rank
            elif self.interrupted:
                self.status = "interrupted"
                self.report = f"{format_rank_set(self.targets)} idle again, their state kept"
                if self.stopped_before or self.stopped_anywhere:
                    window = self.agreed.window if self.agreed is not None else None
                    self.report += "; " + describe_stop_point(self.stopped_before, self.stopped_anywhere, self.behind,
                                                               window)
                if self.restored:
                    self.report += "; " + _restored_note(self.restored)
                if self.note:
                    self.report += f"; {self.note}"
                self.error = RunStoppedError("interrupted", results, self.cell_dir, self.report)
            else:
                self.status = "finished"
            self._end()

    def lose(self, error: SessionLostError) -> None:
        """The session went down under this cell. The error names the root cause once, among the
        rank that died and what this cell's ranks said (a rank that raised first is still it, with
        its cell lines; a peer that only lost its connection never is)."""
        with self._lock:
            if self.done:
                return
            if self.failures:
                error = SessionLostError(error.reason, error.cause, {**error.failures, **self.failures})
            self.status, self.error = "lost", error
            for rank in self.busy_ranks():
                self._set_rank(rank, "killed")
            if self.internal:  # its caller waits for the answers (internal_calls): there will be none
                self.answered.set()
            self._end()

    def _end(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        discard_data(self.cell_dir)  # every rank read the payload (a pushed tensor, say): only its record stays
        self.ended = time.monotonic()
        self._done.set()
        self._emit(RunEvent(self.status, None, self.error or self.report))

    # ---- what users call -----------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> dict:
        """Block until every targeted rank answered; return ``{rank: value}`` or raise the cell's error.

        KeyboardInterrupt while waiting interrupts the cell (the ranks go back to idle, their
        state kept), then propagates. ``timeout`` only limits this wait.
        """
        self._wait_until_done(timeout)
        if self.error is not None:
            raise self.error
        return dict(sorted(self.results.items()))

    def interrupt(self) -> None:
        """Raise KeyboardInterrupt in the user code of every busy rank; wait until they are idle.

        A rank left in a collective is released (its peers drop their connections) and the
        groups are re-formed in place. A rank that can't be brought back within a few seconds
        (stuck in C code) is dumped and the session is stopped, whole tree; the cell then says
        which rank was stuck.
        """
        self.incarnation.interrupt_cell(self)
        self._done.wait(60)  # the ranks answered; the session brings them in step, then the cell ends


def _restored_note(restored: dict) -> str:
    """``"rank 1 put back grad mode on, as the cell found it"``: torch modes the stop left changed."""
    by_modes: dict[tuple, list[int]] = {}
    for rank, modes in sorted(restored.items()):
        by_modes.setdefault(modes, []).append(rank)
    parts = [f"{format_rank_set(ranks)} put back {', '.join(modes)}" for modes, ranks in by_modes.items()]
    return "; ".join(parts) + " as the cell found it (a stop skips the code that would have restored it)"


def _unloadable(rank: int, exc: Exception) -> dict:
    """The error record of a value the rank returned that the kernel can't load."""
    return {"exc_type": type(exc).__name__, "time": time.time(),
            "message": (f"the kernel could not load the value that rank {rank} returned ({type(exc).__name__}: "
                        f"{exc}); return plain data (tensors, numbers, dicts), or make its module importable "
                        f"in the kernel too")}
