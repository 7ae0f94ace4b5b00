"""What a session's kernel and its ranks share besides the run dir: the channel's key file, the cut
request, the socket option both ends set, and how a reply's value is read.

The messages themselves are tuples sent over ``multiprocessing.connection``:
kernel -> rank ``("cell", cell_id, cell_dir, options, payload)`` (``payload`` None: it is in the
cell's dir; ``options``: ``{"check_collectives": bool, "autoreload": Autoreload or None}``),
``("release",)``, ``("close",)``;
rank -> kernel ``("hello", rank, pid, host)``, ``("display", rank, cell_id, data, metadata)``,
``("done", rank, cell_id, kind, body, (offsets at start, offsets at end), watched)`` (``watched``: the
``(path, mtime_ns)`` of the user's module files it imported or reloaded since its last answer). A cell costs one message
each way per rank: a trivial cell's round trip is the floor of a session cell's time.
Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from dataclasses import dataclass

__all__ = ["SESSION_KEY_FILE", "CUT_REQUEST", "STOP_REQUEST", "COLLECTIVES_FILE", "STOP_COUNTS_FILE",
           "STOP_POINT_FILE", "REFORM_CALLED_OFF_FILE", "HEAL_GENERATION_ENV", "HEAL_FILE_ENV", "INLINE_PAYLOAD_MAX",
           "set_nodelay", "shut_down", "read_session_key", "load_value", "Autoreload"]


SESSION_KEY_FILE = "session.key"


@dataclass(frozen=True)
class Autoreload:
    """Which changed modules a session cell reloads on its ranks first (:mod:`nbdist.worker.autoreload`),
    as IPython's ``%autoreload`` modes say: 1, the ``%aimport``-ed ``modules`` only; 2, every module of
    the user's but the ``skip``-ped ones (``%aimport -name``); 3, as 2, and names a module newly defines
    go into the ranks' ``__main__``."""

    mode: int = 2
    modules: tuple = ()
    skip: tuple = ()
    # ((path, mtime_ns), ...): the files the kernel saw change since the ranks imported them (it stats
    # each once for ranks on its machine: nbdist.session.watched_files); None: each rank stats its own.
    changed: tuple | None = None


# A cell's payload up to this size goes with its message; a bigger one (a function's tensor
# argument) is written once into the cell's dir, not once per rank through the kernel's sockets.
INLINE_PAYLOAD_MAX = 256 * 1024


def set_nodelay(conn) -> None:
    """No Nagle on a cell channel: a reply of a few bytes must not wait 40 ms for an ACK."""
    import socket

    with contextlib.suppress(OSError):
        sock = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)  # a dup of the same socket
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        finally:
            sock.close()


CUT_REQUEST = "cut"  # the file, in a cell's dir, by which the kernel asks the ranks stuck in it to cut
# The file, in a cell's dir, that makes the SIGINT sent with it a stop of that cell: a signal that
# reaches a rank after the cell ended (it answered on its own meanwhile) can't stop the next one.
STOP_REQUEST = "stop"
# Where a rank, asked by COLLECTIVES_SIGNAL, writes what it waits in (in the running cell's dir).
COLLECTIVES_FILE = "collectives.{rank}.json"
# A stop at the same collective on every rank: each busy rank's counts per group, then the kernel's point.
STOP_COUNTS_FILE = "stop-counts.{rank}.json"
STOP_POINT_FILE = "stop-point.json"
# In the session's dir: the kernel calls off the re-forming of the groups under one generation (a
# member died), and the ranks waiting for their peers there stop waiting (nbdist.worker.member_arrival).
REFORM_CALLED_OFF_FILE = "reform-{generation}.called-off"
# In a heal's replacement rank's environment: the generation its peers re-form under, and the file
# that holds what the heal hands it (nbdist.session.healing sets them).
HEAL_GENERATION_ENV = "NBDIST_HEAL_GENERATION"
HEAL_FILE_ENV = "NBDIST_HEAL_FILE"


def load_value(body):
    """A value a rank sent: a :class:`~nbdist.protocol.shared_values.SharedValue` (its big buffers
    mapped from the rank's shared memory), or plain pickled bytes."""
    from nbdist.protocol.shared_values import SharedValue, load_shared

    if isinstance(body, SharedValue):
        return load_shared(body)
    return pickle.loads(body)


def shut_down(conn) -> None:
    """Shut a Connection's socket down both ways (its owner keeps the descriptor): a read or a
    handshake blocked on it in another thread ends at once. How a deadline cuts a silent peer."""
    import socket

    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=conn.fileno())
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.detach()  # the Connection still owns the descriptor


def read_session_key(session_dir: str) -> bytes:
    """The session's key (its run dir's 0600 file): the channel's HMAC, and what nbdist signs with."""
    with open(os.path.join(session_dir, SESSION_KEY_FILE), "rb") as fh:
        return fh.read()
