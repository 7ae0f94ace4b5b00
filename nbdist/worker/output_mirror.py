"""The rank's end of the output mirror: a rank on another machine than the kernel tails its own log
files and sends the new bytes, with their offsets, to the kernel (:mod:`nbdist.run.output_channel`).
"""

from __future__ import annotations

import os
import socket
import threading
from multiprocessing.connection import Client

from nbdist.protocol.output_mirror import FORCE_ENV, HEADER, STREAMS

__all__ = ["OutputMirror", "should_mirror"]


def should_mirror(kernel_host: str | None, env=os.environ) -> bool:
    """A rank mirrors its output when it runs on another machine than the kernel."""
    if env.get(FORCE_ENV) == "1":
        return True
    return bool(kernel_host) and socket.gethostname() != kernel_host


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
                    self._conn.send_bytes(HEADER.pack(self._rank, i, self._offsets[i]) + data)
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
