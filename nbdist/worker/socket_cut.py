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

__all__ = ["socket_inodes", "shut_down_sockets", "describe_stuck_thread"]


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


_TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
               "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}


def describe_stuck_thread(native_id: int) -> str:
    """For a rank's log, where a thread waits that shutting its sockets down did not free: its
    system call (number and first argument, from /proc) and each TCP socket's state and ports."""
    parts = []
    with contextlib.suppress(OSError):
        with open(f"/proc/self/task/{native_id}/syscall", encoding="ascii") as fh:
            parts.append("syscall " + " ".join(fh.read().split()[:2]))
    mine = {inode[len("socket:["):-1] for inode in socket_inodes().values()}
    states = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table, encoding="ascii") as fh:
            for line in fh.readlines()[1:]:
                f = line.split()
                if len(f) > 9 and f[9] in mine:
                    local, remote = (int(a.rsplit(":", 1)[1], 16) for a in (f[1], f[2]))
                    states.append(f"{_TCP_STATES.get(f[3], f[3])} :{local}->:{remote}")
    parts.append(f"{len(states)} TCP sockets: " + (", ".join(sorted(states)) or "none"))
    return "; ".join(parts)
