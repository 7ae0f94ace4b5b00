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
import os
import secrets
import socket
import struct
import threading
from multiprocessing.connection import Client, Listener

__all__ = ["OutputChannel", "OutputMirror", "new_channel_key", "should_mirror"]

_HEADER = struct.Struct("!iBQ")  # rank, stream (0 stdout, 1 stderr), byte offset in the log file
STREAMS = ("stdout", "stderr")
FORCE_ENV = "NBDIST_MIRROR_OUTPUT"  # "1": mirror even on the kernel's machine (what the tests use)


def new_channel_key() -> str:
    return secrets.token_hex(32)


def should_mirror(kernel_host: str | None, env=os.environ) -> bool:
    """A rank mirrors its output when it runs on another machine than the kernel."""
    if env.get(FORCE_ENV) == "1":
        return True
    return bool(kernel_host) and socket.gethostname() != kernel_host


class OutputChannel:
    """The kernel's end: accept authenticated ranks and keep what they send, by rank.

    Examples
    --------
    >>> ch = OutputChannel("10.0.0.1", key)      # made by start_run for engine launchers
    >>> ch.take(3)                                # [(stream, offset, bytes), ...] for rank 3
    """

    def __init__(self, host: str, key: str):
        self._listener = Listener((host, 0), family="AF_INET", authkey=bytes.fromhex(key))
        self.address = self._listener.address
        self._pieces: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()
        self._closed = False
        self.refused = 0  # connections that failed the challenge
        threading.Thread(target=self._accept, name="nbdist-output-channel", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()  # runs the HMAC challenge both ways
            except OSError:  # closed
                return
            except Exception:  # a peer without the key (AuthenticationError) or a broken handshake
                self.refused += 1
                continue
            threading.Thread(target=self._read, args=(conn,), name="nbdist-output-reader", daemon=True).start()

    def _read(self, conn) -> None:
        with conn:
            while True:
                try:
                    msg = conn.recv_bytes()
                except (EOFError, OSError):
                    return
                if len(msg) < _HEADER.size:
                    continue
                rank, stream, offset = _HEADER.unpack_from(msg)
                if stream >= len(STREAMS):
                    continue
                data = msg[_HEADER.size:]
                with self._lock:
                    self._pieces[rank].append((STREAMS[stream], offset, data))

    def take(self, rank: int) -> list[tuple[str, int, bytes]]:
        """What arrived for ``rank`` since the last call, oldest first."""
        with self._lock:
            pieces = self._pieces.pop(rank, None)
        return list(pieces or ())

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass


class OutputMirror:
    """The rank's end: tail this rank's own log files and send the new bytes to the kernel."""

    def __init__(self, address, key: str, run_dir: str, rank: int, interval: float = 0.1):
        self._conn = Client(tuple(address), family="AF_INET", authkey=bytes.fromhex(key))
        self._paths = [os.path.join(run_dir, f"rank{rank}.{s}") for s in STREAMS]
        self._offsets = [0, 0]
        self._rank = rank
        self._interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nbdist-output-mirror", daemon=True)
        self._thread.start()

    def _send_new(self) -> None:
        with self._lock:
            for i, path in enumerate(self._paths):
                try:
                    with open(path, "rb") as fh:
                        fh.seek(self._offsets[i])
                        data = fh.read(1 << 20)
                except FileNotFoundError:
                    continue
                if data:
                    self._conn.send_bytes(_HEADER.pack(self._rank, i, self._offsets[i]) + data)
                    self._offsets[i] += len(data)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._send_new()
            except OSError:  # the kernel is gone or closed the run: the log files still have it all
                return

    def close(self) -> None:
        """Send what is left, then hang up (called as the rank exits normally)."""
        self._stop.set()
        self._thread.join(timeout=2)
        try:
            self._send_new()
            self._conn.close()
        except OSError:
            pass

