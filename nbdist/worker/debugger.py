"""pdb in a session rank, with the notebook's stdin as its terminal.

``breakpoint()`` and ``pdb.set_trace()`` in a session cell stop this rank in :class:`RankPdb`: a
``pdb.Pdb`` whose input is the kernel. Each time pdb wants a command, the rank sends what pdb
printed since the last one and where it stands, and waits for the kernel's answer (the user's
line from the notebook's stdin box, see :mod:`nbdist.frontend.debugger_prompt`); when pdb lets the
code run on, it says so. The stop button ends debugging the way it ends any cell: pdb quits and the
cell is interrupted, the rank's state kept. ``%dist_debug`` runs :func:`post_mortem` on a rank: the
same prompt, in the frame where its last cell raised.

Ranks of one-shot runs have no way back to the notebook: there ``breakpoint()`` says so in one line
and the code goes on (:func:`skip_breakpoints`).
"""

from __future__ import annotations

import io
import os
import pdb
import sys

__all__ = ["RankPdb", "install", "post_mortem", "remember_failure", "forget_failure", "skip_breakpoints"]

_ASK = None  # (text, where) -> the kernel's command; set by the session loop for its cell
_RESUMED = None  # (text) -> None: pdb let the code run on
_LAST_FAILURE = None  # the traceback of this rank's last failed cell, for post-mortem


class _KernelInput:
    """pdb's stdin: each line is a command the kernel sends."""

    def __init__(self, debugger: RankPdb):
        self._debugger = debugger

    def readline(self) -> str:
        return self._debugger.ask_kernel()


class RankPdb(pdb.Pdb):
    """pdb whose commands come from the notebook, through the kernel (see the module's doc)."""

    def __init__(self):
        self._out = io.StringIO()
        super().__init__(stdin=_KernelInput(self), stdout=self._out, nosigint=True, readrc=False)
        self.prompt = ""  # the notebook's prompt names the rank ("(Pdb rank 1) ")

    def _take_output(self) -> str:
        text = self._out.getvalue()
        self._out.seek(0)
        self._out.truncate()
        return text

    def ask_kernel(self) -> str:
        frame = self.curframe
        where = ""
        if frame is not None:
            where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
        command = _ASK(self._take_output(), where)
        return command + "\n"

    def interaction(self, frame, traceback):
        try:
            super().interaction(frame, traceback)
        finally:
            _RESUMED(self._take_output())


def _set_trace(*args, **kwargs) -> None:
    """``breakpoint()`` and ``pdb.set_trace()`` in a session cell: stop here, ask the notebook."""
    if _ASK is None:  # between cells (an atexit hook, a thread after its cell): nobody to ask
        return
    RankPdb().set_trace(sys._getframe().f_back)


def install(ask, resumed) -> None:
    """Route this rank's breakpoints to the kernel through ``ask`` and ``resumed`` (for the cell
    that starts; ``install(None, None)`` when it ended)."""
    global _ASK, _RESUMED
    _ASK, _RESUMED = ask, resumed
    sys.breakpointhook = _set_trace
    pdb.set_trace = _set_trace


def remember_failure(exc: BaseException) -> None:
    global _LAST_FAILURE
    _LAST_FAILURE = exc.__traceback__


def forget_failure() -> None:
    """A new cell: what failed before it is no longer what ``%dist_debug`` shows."""
    global _LAST_FAILURE
    _LAST_FAILURE = None


def post_mortem() -> bool:
    """Run by ``%dist_debug`` on a rank: pdb in the frame where its last cell raised. False when
    that rank has no failure to show."""
    if _LAST_FAILURE is None:
        return False
    debugger = RankPdb()
    debugger.reset()
    tb = _LAST_FAILURE
    while tb.tb_next is not None and "nbdist" + os.sep + "worker" in tb.tb_frame.f_code.co_filename:
        tb = tb.tb_next  # start in the user's frames, not nbdist's
    debugger.interaction(None, tb)
    return True


def skip_breakpoints(rank: int) -> None:
    """One-shot ranks: ``breakpoint()`` says in one line that it needs a session, and goes on."""
    def skip(*args, **kwargs) -> None:
        frame = sys._getframe(1)
        print(f"nbdist: rank {rank}: breakpoint() at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} "
              f"skipped: the debugger needs a session's ranks (%dist_start, or nbdist.Session)",
              file=sys.stderr, flush=True)

    sys.breakpointhook = skip
    pdb.set_trace = skip
