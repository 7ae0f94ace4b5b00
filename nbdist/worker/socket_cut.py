"""This process's sockets by inode, and shutting one down from another thread.

A thread of the rank frees the main thread from a wait in C on a socket (a collective's, or the
store's in gloo's connect) by shutting the socket itself down, through a duplicate of its file
descriptor: the wait fails at once, here and at the peer. The inode tells that the number still
names the socket it was taken for, not one opened since under a reused number.
"""

from __future__ import annotations

import contextlib
import os
import socket

__all__ = ["socket_inodes", "shut_down_sockets"]


def socket_inodes(fds=None) -> dict[int, str]:
    """``{fd: "socket:[inode]"}`` of this process's sockets (of ``fds`` only, if given)."""
    out = {}
    for fd in fds if fds is not None else os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:"):
                out[int(fd)] = target
    return out


def shut_down_sockets(sockets: dict[int, str]) -> int:
    """Shut down each of ``sockets`` (``{fd: inode}``) that is still that socket, listeners left
    alone (gloo's aborts the process if its listener fails); returns how many were."""
    done = 0
    for fd, inode in sockets.items():
        if socket_inodes([fd]).get(fd) != inode:
            continue  # closed since (and the number perhaps reused): not ours any more
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            try:
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    sock.shutdown(socket.SHUT_RDWR)  # acts on the socket itself, not this duplicate
                    done += 1
            finally:
                sock.close()
    return done
