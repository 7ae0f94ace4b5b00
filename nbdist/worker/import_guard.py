"""A stop that lands in the middle of an import waits for the import to end.

Python can't take an import back. A KeyboardInterrupt raised while a module runs its top level
leaves that module out of ``sys.modules`` but the submodules it imported in, and what C code
registered as it ran (torch's operator library) registered. The next import of it then fails for
the rest of the rank's life ("partially initialized module 'torch._inductor'", "Tried to register
an operator ... multiple times"): seen when the stop button landed in a healed rank's first
optimizer step, which imports ``torch._dynamo`` (two seconds on a busy 2-core box).

So the rank's SIGINT handler asks :func:`hold` first: a stop whose frame is inside importlib's
machinery is held, and a watcher thread sends SIGINT to the main thread again the moment no import
runs there (polling its frame every 10 ms), or once :data:`IMPORT_HOLD_S` has passed: a module
whose top level never ends (a loop at import) is stopped where it is, as before. Where the ranks agree a
stop point, the kernel gives a rank that imports in a cell's code time to finish and reach it
(:mod:`nbdist.worker.stop_point` reports it), so that it stops with its peers. Standard library only.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

__all__ = ["hold", "importing", "importing_in_cell", "IMPORT_HOLD_S"]

IMPORT_HOLD_S = 30.0  # past this, a stop held for an import is delivered inside it anyway
_POLL_S = 0.01
_held_since: float | None = None  # when the stop now held was first held (None: none is)
_watching = False  # a watcher waits to send it again (the next SIGINT may land in the cell's next import)


def importing(frame) -> bool:
    """Whether ``frame`` (or a caller of it) runs inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def importing_in_cell(frame, cell_runner: str = "_run_one") -> bool:
    """Whether ``frame`` imports on behalf of a cell's own code: an import with a frame of the
    notebook's (``__main__``'s: the cell, or a function a cell defined) above ``cell_runner``'s, not
    one of nbdist's reading the cell's payload."""
    if not importing(frame):
        return False
    while frame is not None and frame.f_code.co_name != cell_runner:
        if frame.f_globals.get("__name__") == "__main__":
            return True
        frame = frame.f_back
    return False


def hold(frame, still_wanted) -> bool:
    """In the SIGINT handler (main thread), for the interrupted ``frame``: True when the stop must
    wait for an import to end; SIGINT then comes again once it has, if ``still_wanted()`` (the same
    cell still runs). False: raise it now (no import, or one held past :data:`IMPORT_HOLD_S`)."""
    global _held_since, _watching
    now = time.monotonic()
    if not importing(frame) or (_held_since is not None and now - _held_since > IMPORT_HOLD_S):
        _held_since = None
        return False
    if _held_since is None:
        _held_since = now
    if not _watching:  # also for a re-sent stop that landed in the next import: it waits for that one
        _watching = True
        threading.Thread(target=_deliver_after_import,
                         args=(threading.main_thread().ident, still_wanted),
                         name="nbdist-stop-after-import", daemon=True).start()
    return True


def _deliver_after_import(main_ident: int, still_wanted) -> None:
    global _held_since, _watching
    deadline = time.monotonic() + IMPORT_HOLD_S
    while time.monotonic() <= deadline:
        frame = sys._current_frames().get(main_ident)
        if frame is None or not importing(frame):
            break
        time.sleep(_POLL_S)
    else:
        time.sleep(_POLL_S)  # past the deadline: hold() lets the next one through
    _watching = False
    if not still_wanted():
        _held_since = None
        return
    signal.pthread_kill(main_ident, signal.SIGINT)
