"""Live output from ranks on other machines: an authenticated channel that mirrors their log files.

A rank always writes fd 1 and 2 into its log files in the run dir: that stays the complete
record. On a shared filesystem, though, another machine's appends reach the kernel late (NFS
shows them after the writer closes or the attribute cache expires). So a rank that is not on
the kernel's machine also tails its own log files and sends each new piece, with its byte
offset, to the kernel over ``multiprocessing.connection`` (an HMAC challenge with a per-run key
from the run's spec, which only the user can read). The kernel feeds the pieces to the same
followers that read the files; the offsets make the two sources agree, so a byte is shown once
whichever way it came, and the final read of the file fills in whatever the channel missed.
"""

from __future__ import annotations

import collections
import secrets
import threading

from nbdist.protocol.output_mirror import HEADER, STREAMS
from nbdist.run.rank_listener import RankHello, RankListener

__all__ = ["OutputChannel", "new_channel_key"]


def new_channel_key() -> str:
    return secrets.token_hex(32)


class OutputChannel:
    """The kernel's end: accept authenticated ranks and keep what they send, by rank.

    The listener is the sessions' own (:class:`~nbdist.run.rank_listener.RankListener`): sized for
    the world, each handshake on its own thread with a deadline, so a silent or garbage connection
    to this port (it is on the cluster's address) blocks no rank behind it.

    Examples
    --------
    >>> ch = OutputChannel("10.0.0.1", key, nprocs=16)   # made by start_run for engine launchers
    >>> ch.take(3)                                         # [(stream, offset, bytes), ...] for rank 3
    """

    def __init__(self, host: str, key: str, nprocs: int = 64):
        self._listener = RankListener(host, bytes.fromhex(key), nprocs)
        self.address = self._listener.address
        self._pieces: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()
        self.received: collections.Counter = collections.Counter()  # rank -> bytes that came this way
        self._listener.serve(self._on_hello)

    @property
    def refused(self) -> int:
        """Connections that failed the handshake (a wrong key, garbage, silence past the deadline)."""
        return self._listener.refused

    def _on_hello(self, hello: RankHello) -> None:
        threading.Thread(target=self._read, args=(hello.conn,), name="nbdist-output-reader", daemon=True).start()

    def _read(self, conn) -> None:
        with conn:
            while True:
                try:
                    msg = conn.recv_bytes()
                except (EOFError, OSError):
                    return
                if len(msg) < HEADER.size:
                    continue
                rank, stream, offset = HEADER.unpack_from(msg)
                if stream >= len(STREAMS):
                    continue
                data = msg[HEADER.size:]
                with self._lock:
                    self._pieces[rank].append((STREAMS[stream], offset, data))
                    self.received[rank] += len(data)

    def take(self, rank: int) -> list[tuple[str, int, bytes]]:
        """What arrived for ``rank`` since the last call, oldest first."""
        with self._lock:
            pieces = self._pieces.pop(rank, None)
        return list(pieces or ())

    def close(self) -> None:
        self._listener.close()
