"""The rank's end of the kernel's channel (:mod:`nbdist.run.rank_listener`): connect, prove the key
both ways, say hello, all within one deadline.

``multiprocessing.connection.Client`` has no deadline: a kernel host that drops the packets, or a
listener whose queue is full, leaves the rank in ``connect()`` or in the challenge for ever, and the
cell in "starting". Here the TCP connect has the deadline's time left, and the HMAC exchange (the
same ``answer_challenge``/``deliver_challenge`` that ``Client`` runs) is cut short by shutting the
socket down when the deadline passes. Standard library only.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from nbdist.protocol.session_channel import shut_down

__all__ = ["connect_to_kernel", "KernelUnreachable", "CONNECT_TIMEOUT_S"]

CONNECT_TIMEOUT_S = 60.0  # a rank on a busy box or a slow network: seconds; a dead address: this


class KernelUnreachable(ConnectionError):
    """The kernel's channel did not take this rank within the deadline (says where and how long)."""


def connect_to_kernel(address, key: bytes, rank: int, timeout: float = CONNECT_TIMEOUT_S) -> Connection:
    """An authenticated :class:`~multiprocessing.connection.Connection` to the kernel, hello sent.

    Raises :class:`KernelUnreachable` when the connect, the handshake or the hello does not finish
    within ``timeout`` seconds, or the kernel refuses the key.
    """
    host, port = address[0], int(address[1])
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=max(0.1, timeout))
    except OSError as exc:
        raise KernelUnreachable(f"rank {rank} could not reach the kernel at {host}:{port}: {exc}") from None
    sock.settimeout(None)  # the Connection reads the descriptor itself: blocking, cut by the timer
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = Connection(sock.detach())
    timer = threading.Timer(max(0.0, deadline - time.monotonic()), shut_down, args=(conn,))
    timer.daemon = True
    timer.start()
    try:
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
        conn.send(("hello", rank, os.getpid(), socket.gethostname()))
    except Exception as exc:
        conn.close()
        what = "did not finish its handshake in time" if time.monotonic() >= deadline else f"refused it ({exc!r})"
        raise KernelUnreachable(f"rank {rank}: the kernel's channel at {host}:{port} {what}") from None
    finally:
        timer.cancel()
    return conn
