"""Where ranks connect to the kernel, for a session's cells and for a run's live output from other
machines: one listener sized for the world, a handshake per connection that can't hold up the
others, and a deadline that says who never came.

``multiprocessing.connection.Listener`` listens with a backlog of 1 and runs the HMAC handshake
inside ``accept()``: eight ranks connecting at once overflow the queue (the dropped ones believe
they are connected and wait for a challenge for ever), and one silent peer blocks every rank
behind it. So the socket here listens with a backlog that fits the world, each accepted connection
is authenticated on a thread of its own with a deadline (``deliver_challenge``/``answer_challenge``,
the same HMAC exchange ``Listener`` and ``Client`` make), and the accept loop itself waits with a
deadline. A session stops listening once every rank is in (:meth:`RankListener.accept_all`); a run's
output channel listens for the run's life (:meth:`RankListener.serve`), since ranks of an engine
connect whenever they start. Either way a silent or garbage connection costs one thread for at most
``HANDSHAKE_TIMEOUT_S`` and blocks nobody. The rank's end is :func:`nbdist.worker.kernel_connect.connect_to_kernel`.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from nbdist.protocol.session_channel import set_nodelay, shut_down

__all__ = ["RankHello", "RankListener", "HANDSHAKE_TIMEOUT_S"]

HANDSHAKE_TIMEOUT_S = 20.0  # a rank that connected says hello within milliseconds; a busy box, seconds


@dataclass
class RankHello:
    """A rank that connected and proved it holds the session's key."""

    rank: int
    pid: int
    host: str
    conn: Connection


class RankListener:
    """Accept authenticated ranks on ``(host, 0)``; see the module's docstring.

    Examples
    --------
    >>> listener = RankListener("127.0.0.1", key, nprocs=8)
    >>> listener.accept_all(deadline, on_hello=register, keep_going=lambda: status == "starting")
    """

    def __init__(self, host: str, key: bytes, nprocs: int):
        self._key = key
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((host, 0))
            # Every rank may connect in the same millisecond: the queue holds them all.
            self._sock.listen(max(64, 2 * nprocs))
        except BaseException:
            self._sock.close()
            raise
        self.address = self._sock.getsockname()[:2]
        self.refused = 0  # connections that failed the handshake (a wrong key, a port scanner)
        self._closed = False
        self._lock = threading.Lock()

    def accept_all(self, nprocs: int, deadline: float, on_hello, keep_going) -> set[int]:
        """Accept until ``nprocs`` distinct ranks said hello (each reported through ``on_hello``),
        ``deadline`` (monotonic) passes, or ``keep_going()`` turns False; return the ranks that did."""
        arrived: set[int] = set()
        done = threading.Condition()
        # The loop waits in select(); a handshake that ends wakes it through this pair at once (a poll
        # would add its period to every start and every heal, after the last rank said hello).
        wake_r, wake_w = socket.socketpair()

        def greeted(hello: RankHello) -> None:
            with done:
                if hello.rank in arrived or not keep_going():
                    hello.conn.close()
                    return
                arrived.add(hello.rank)
                on_hello(hello)
                done.notify_all()
            with contextlib.suppress(OSError):  # the loop may have ended and closed it
                wake_w.send(b"x")

        try:
            while len(arrived) < nprocs and keep_going() and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    readable, _, _ = select.select([self._sock, wake_r], [], [], min(left, 0.5))
                except (OSError, ValueError):  # closed under us
                    break
                if wake_r in readable:
                    wake_r.recv(4096)
                if self._sock not in readable:
                    continue
                try:
                    client, _ = self._sock.accept()
                except OSError:
                    continue
                threading.Thread(target=self._greet, args=(client, greeted), name="nbdist-session-handshake",
                                 daemon=True).start()
            with done:  # handshakes in flight finish (or time out) within their own deadline
                done.wait_for(lambda: len(arrived) >= nprocs or not keep_going(),
                              timeout=max(0.0, min(HANDSHAKE_TIMEOUT_S, deadline - time.monotonic())))
                return set(arrived)
        finally:
            wake_r.close()
            wake_w.close()

    def serve(self, on_hello) -> threading.Thread:
        """Accept ranks until :meth:`close`, on a thread of its own; each that says hello is given
        to ``on_hello`` (from its handshake's thread)."""
        def loop() -> None:
            while not self._closed:
                try:
                    readable, _, _ = select.select([self._sock], [], [], 0.5)
                    if readable:
                        client, _ = self._sock.accept()
                        threading.Thread(target=self._greet, args=(client, on_hello), daemon=True,
                                         name="nbdist-channel-handshake").start()
                except (OSError, ValueError):  # closed under us, or a peer that left before accept
                    continue

        thread = threading.Thread(target=loop, name="nbdist-channel-accept", daemon=True)
        thread.start()
        return thread

    def _greet(self, client: socket.socket, greeted) -> None:
        """The HMAC handshake both ways, then the rank's hello; a peer that is silent past the
        deadline has its socket shut down, which ends the wait here and nowhere else."""
        conn = Connection(client.detach())
        timer = threading.Timer(HANDSHAKE_TIMEOUT_S, shut_down, args=(conn,))
        timer.daemon = True
        timer.start()
        try:
            deliver_challenge(conn, self._key)
            answer_challenge(conn, self._key)
            kind, rank, pid, host = conn.recv()
            if kind != "hello":
                raise ValueError(f"expected a hello, got {kind!r}")
        except Exception:  # a wrong key, a peer that went away or stayed silent: it is not a rank of ours
            with self._lock:
                self.refused += 1
            conn.close()
            return
        finally:
            timer.cancel()
        set_nodelay(conn)
        greeted(RankHello(int(rank), int(pid), str(host), conn))

    def close(self) -> None:
        """Stop listening: nothing else may connect (an accept in progress ends at once)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
