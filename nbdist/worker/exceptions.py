"""How a rank describes an exception for the kernel: the error record of ``error.{R}.json``.

User frames only (nbdist's own and the launcher plumbing go), a hint for the errors people meet
most (CUDA after fork, a port in use, a module the ranks can't import, pickling), and whether the
error only says that a peer went away (never a root cause). Standard library only.
"""

from __future__ import annotations

import os
import time
import traceback

__all__ = ["describe_exception", "PEER_LOSS_MARKERS"]


# Messages that a rank sees when a *peer* died: never the root cause if another rank failed too.
PEER_LOSS_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL is aborted",
    "Socket Timeout",
    "Connection refused",
    "ReformCalledOff: ",  # a re-forming a member's death ended (nbdist.worker.member_arrival)
)


_HINTS = (
    (
        "Cannot re-initialize CUDA in forked subprocess",
        "CUDA was initialised in the kernel before the ranks were forked; use start_method='spawn' "
        "(the default), or restart the kernel and don't touch CUDA before launching",
    ),
    (
        "address already in use",
        "the rendezvous port is taken; leave dist_url='auto' so nbdist picks a free port and holds it",
    ),
    (
        "EADDRINUSE",
        "the rendezvous port is taken; leave dist_url='auto' so nbdist picks a free port and holds it",
    ),
    (
        "No module named",
        "the ranks import modules by name: install the module in the kernel's environment, or "
        "define the code in the notebook so it travels by value",
    ),
    (
        "pickle",
        "values crossing to or from the ranks must be picklable; build the object inside the "
        "function, or return plain tensors, numbers and dicts",
    ),
)


def _user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """Frames from the user's code: nbdist's own frames and the launcher plumbing go."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nbdist/
    frames = traceback.extract_tb(exc.__traceback__)
    return [f for f in frames if not os.path.abspath(f.filename).startswith(here + os.sep)]


def _is_library_file(filename: str) -> bool:
    """Installed packages and the standard library: not the user's code."""
    import sysconfig

    path = os.path.abspath(filename)
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return "site-packages" in path or "dist-packages" in path or any(path.startswith(r + os.sep) for r in roots)


def _format_frames(frames, exc) -> str:
    body = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) if frames else ""
    return body + "".join(traceback.format_exception_only(type(exc), exc))


def describe_exception(exc: BaseException) -> dict:
    """The error record a rank leaves in ``error.{R}.json``.

    ``traceback`` drops nbdist's own frames; ``user_traceback`` keeps only the user's code (the
    cell, notebook functions, the user's own modules), which is what a notebook shows.
    """
    frames = _user_frames(exc)
    full = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    body = _format_frames(frames, exc)
    mine = [f for f in frames if not _is_library_file(f.filename)]
    text = f"{type(exc).__name__}: {exc}"
    hint = next((h for marker, h in _HINTS if marker.lower() in text.lower()), None)
    return {
        "exc_type": type(exc).__name__,
        "message": str(exc),
        "traceback": body,
        "user_traceback": _format_frames(mine or frames, exc),
        "full_traceback": full,
        "hint": hint,
        "secondary": any(m in text for m in PEER_LOSS_MARKERS),
        "time": time.time(),
        "pid": os.getpid(),
    }
