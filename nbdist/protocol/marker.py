"""The run marker of processes that were forked, not exec'd: rewrite it where ``/proc`` reads it.

``nbdist.ps()`` from any process finds a run's processes by ``NBDIST_RUN_ID`` in
``/proc/PID/environ``. That file shows the environment block the process got from ``execve``,
not later changes to ``os.environ``, so a rank forked from the warm template would show the
template's marker. The template is therefore exec'd with fixed-size slots for the marker
variables, and a forked rank writes its own run id and run dir into those slots, in place, the way
``setproctitle`` rewrites argv. Its DataLoader workers inherit the block, and what it execs gets
the real ``os.environ``: every process of the run carries the marker, found by value, never by name.

Readers strip the padding (:func:`read_marker`). Standard library only.
"""

from __future__ import annotations

import ctypes

from nbdist.protocol.rundir import RUN_DIR_ENV, RUN_ID_ENV

__all__ = ["MARKER_SLOTS", "reserve_marker_env", "stamp_marker", "read_marker"]

# Bytes reserved per variable: a run id is 22 characters (28 for a template's), a run dir a path.
MARKER_SLOTS = {RUN_ID_ENV: 64, RUN_DIR_ENV: 4096}
_PAD = " "  # NUL would end the block for readers that stop at an empty entry (psutil does)


def reserve_marker_env(env: dict, run_id: str, run_dir: str) -> dict:
    """``env`` with the marker variables set to ``run_id``/``run_dir``, padded to their slot sizes."""
    out = {k: v for k, v in env.items() if k not in MARKER_SLOTS}
    for key, value in ((RUN_ID_ENV, run_id), (RUN_DIR_ENV, run_dir)):
        if len(value.encode()) > MARKER_SLOTS[key]:
            raise ValueError(f"{key} value is longer than its {MARKER_SLOTS[key]}-byte slot: {value!r}")
        out[key] = value.ljust(MARKER_SLOTS[key], _PAD)
    return out


def stamp_marker(run_id: str, run_dir: str) -> bool:
    """Write ``run_id`` and ``run_dir`` into this process's exec-time environment block.

    Call before anything changes those variables through ``os.environ`` (which would point the C
    ``environ`` at new strings and leave the slots unreachable). Returns False when a slot is
    missing or too small; the caller then says so, since ``nbdist.ps()`` could not find the process.
    """
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_void_p
    libc.getenv.argtypes = [ctypes.c_char_p]
    slots = []
    for key, value in ((RUN_ID_ENV, run_id), (RUN_DIR_ENV, run_dir)):
        addr = libc.getenv(key.encode())
        if not addr:
            return False
        size = len(ctypes.string_at(addr))
        data = value.encode()
        if size != MARKER_SLOTS[key] or len(data) > size:
            return False
        slots.append((addr, data.ljust(size, _PAD.encode())))
    for addr, data in slots:
        ctypes.memmove(addr, data, len(data))
    return True


def read_marker(env: dict) -> tuple[str | None, str | None]:
    """``(run_id, run_dir)`` from a process's environment as ``/proc`` shows it, padding removed."""
    rid, rdir = env.get(RUN_ID_ENV), env.get(RUN_DIR_ENV)
    return (rid.rstrip(_PAD) or None) if rid else None, (rdir.rstrip(_PAD) or None) if rdir else None
