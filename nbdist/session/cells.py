"""The cell level of a :class:`nbdist.Session`: send a cell to some ranks, stop it, see its stacks.

A session has two levels (see :mod:`nbdist.session.handle`): this is the one whose steps end with the
cell (finished, failed or interrupted, the ranks idle again, their state kept). The session
level (start, lose, close, restart) stays in :mod:`nbdist.session.handle`; bringing the ranks back in
step after an abnormal cell is :mod:`nbdist.session.recovery`.
"""

from __future__ import annotations

import os
import threading

from nbdist.protocol import rundir
from nbdist.errors import LaunchConfigError, format_rank_set
from nbdist.session.recovery import CHECK_TIMEOUT_S, RELEASE_AFTER_S, stop_cell
from nbdist.session.cell_handle import CellHandle
from nbdist.worker.session_loop import get_name, set_names

__all__ = ["CellLevel"]


class CellLevel:
    """What a :class:`nbdist.Session` does with cells (a mixin: the state is the session's)."""

    def run(self, fn, *args, ranks=None, timeout=None, join=True, **kwargs):
        """Run ``fn(*args, **kwargs)`` on the session's ranks (or ``ranks``); return ``{rank: value}``.

        Raises WorkerFailedError (the rank that raised first, with its traceback) when a rank
        raised; the ranks are then idle again with their state kept. ``join=False`` returns the
        :class:`~nbdist.session.cell_handle.CellHandle`. ``timeout`` interrupts the cell when it expires.
        """
        cell = self._submit(lambda cell_dir: rundir.write_payload(cell_dir, fn, args, kwargs), ranks, timeout)
        return cell if not join else cell.wait()

    def execute(self, code: str, ranks=None, timeout=None, join=True):
        """Run source text on the ranks, in their ``__main__``: its last expression is each rank's value."""
        import ast

        from nbdist.worker.cell import run_cell

        def write(cell_dir):
            cell_file = os.path.join(cell_dir, "cell.py")
            text = code if code.endswith("\n") else code + "\n"
            ast.parse(text, filename=cell_file)  # a SyntaxError names the line before anything runs
            rundir.write_private(cell_file, text.encode("utf-8"))  # tracebacks show the code's own lines
            rundir.write_payload(cell_dir, run_cell, (cell_file, {}, {}, []), {})

        cell = self._submit(write, ranks, timeout)
        return cell if not join else cell.wait()

    def push(self, ranks=None, **values) -> None:
        """Set ``values`` as names in each rank's namespace."""
        self.run(set_names, values, ranks=ranks)

    def pull(self, name: str, ranks=None) -> dict:
        """``{rank: value}`` of ``name`` in each rank's namespace."""
        return self.run(get_name, name, ranks=ranks)

    def _submit(self, write, ranks, timeout) -> CellHandle:
        targets = self.prepare(ranks)
        cell_dir = self.new_cell_dir()
        try:
            write(cell_dir)
        except BaseException:
            rundir.discard_run_dir(cell_dir)
            raise
        return self.start_cell(cell_dir, targets, timeout)

    def prepare(self, ranks=None) -> list[int]:
        """Wait until the session can take a cell; return the ranks it will run on.

        Raises SessionLostError when it can't (lost, closed), RuntimeError while a cell runs.
        """
        self.wait_ready()  # a cell sent while the session starts waits for it
        self._in_step.wait(CHECK_TIMEOUT_S + 10)  # and one sent while it re-forms with other nodes
        targets = sorted(self._conns) if ranks is None else sorted(set(ranks))
        unknown = [r for r in targets if r not in self._conns]
        if unknown or not targets:
            raise LaunchConfigError(f"ranks must be a subset of {format_rank_set(self._conns)}, got {ranks!r}")
        if self.status == "busy":
            raise RuntimeError(f"cell {self._active.cell_id} is still running in this session; "
                               "wait for it or interrupt it")
        return targets

    def new_cell_dir(self) -> str:
        """A private folder for the next cell's record (its payload, its source)."""
        with self._lock:
            self._cells += 1
            cell_dir = os.path.join(self.run_dir, "cells", f"{self._cells:04d}")
        os.makedirs(cell_dir, mode=0o700)
        return cell_dir

    def start_cell(self, cell_dir: str, targets: list[int], timeout=None, internal: bool = False) -> CellHandle:
        """Send the payload written in ``cell_dir`` to ``targets``; return the cell's handle at once.

        ``internal``: nbdist's own call while it brings the ranks in step after a user's cell.
        """
        with self._lock:
            if self.status != ("busy" if internal else "idle"):
                raise RuntimeError(f"the session is {self.status}; it can't take a cell now")
            cell = self._active = CellHandle(self, int(os.path.basename(cell_dir)), targets, cell_dir, internal)
            self.status = "busy"
        self._send(targets, ("cell", cell.cell_id, cell_dir))
        if timeout is not None:
            timer = threading.Timer(timeout, self.interrupt_cell, args=(cell,))
            timer.daemon = True
            timer.start()
        return cell

    def interrupt(self) -> None:
        """The stop button: interrupt the running cell, if any; the ranks keep their state."""
        if self._active is not None and not self._active.done:
            self.interrupt_cell(self._active)

    def _send(self, ranks, message) -> None:
        with self._send_lock:  # the stop button's thread and the cell's may both write
            for rank in ranks:
                self._conns[rank].send(message)

    def interrupt_cell(self, cell: CellHandle, release_after: float = RELEASE_AFTER_S) -> None:
        """SIGINT to every busy rank; release a rank left in a collective; a stuck one ends the session
        (:func:`nbdist.session.recovery.stop_cell`)."""
        stop_cell(self, cell, release_after)

    def _dump_stacks(self, ranks) -> str:
        """Each stuck rank's stack into its log (as a timeout does); where the first one stood."""
        dumps = self.stacks(ranks, timeout=0.5)
        first = dumps.get(ranks[0])
        return f", {first.where}; stacks in the rank logs" if first is not None else ""

    def stacks(self, ranks=None, timeout: float = 2.0) -> dict:
        """Every rank's Python stack, now, without stopping anything: ``{rank: StackDump}``.

        The answer to "is it hung, and where?". Each dump also goes into the rank's log.
        """
        from nbdist.run.stacks import dump_stacks

        ranks = [r for r in (sorted(self._pids) if ranks is None else ranks) if r not in self._remote]
        return dump_stacks({r: (self._pids.get(r), rundir.log_path(self.run_dir, r, "stderr")) for r in ranks},
                           timeout)
