"""The rank's end of the output mirror: a rank on another machine than the kernel tails its own log
files and sends the new bytes, with their offsets, to the kernel (:mod:`nbdist.run.output_channel`).
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from nbdist.protocol.output_mirror import FORCE_ENV, HEADER, STREAMS
from nbdist.worker.kernel_connect import KernelUnreachable, connect_to_kernel

__all__ = ["OutputMirror", "should_mirror"]


def should_mirror(kernel_host: str | None, env=os.environ) -> bool:
    """A rank mirrors its output when it runs on another machine than the kernel."""
    if env.get(FORCE_ENV) == "1":
        return True
    return bool(kernel_host) and socket.gethostname() != kernel_host


class OutputMirror:
    """The rank's end: tail this rank's own log files and send the new bytes to the kernel."""

    def __init__(self, address, key: str, run_dir: str, rank: int, interval: float = 0.1,
                 connect_timeout: float = 30.0):
        self._address, self._key, self._connect_timeout = tuple(address), bytes.fromhex(key), connect_timeout
        self._conn = None  # connected on the mirror's thread: the rank's code never waits for it
        self._paths = [os.path.join(run_dir, f"rank{rank}.{s}") for s in STREAMS]
        self._offsets = [0, 0]
        self._rank = rank
        self._interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nbdist-output-mirror", daemon=True)
        self._thread.start()

    def _send_new(self) -> None:
        if self._conn is None:
            return  # never connected: the log files have it all
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
        try:
            self._conn = connect_to_kernel(self._address, self._key, self._rank, self._connect_timeout)
        except KernelUnreachable as exc:  # the shared log files still carry everything
            print(f"nbdist: no live output channel to the kernel ({exc})", file=sys.stderr, flush=True)
            return
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
            if self._conn is not None:
                self._conn.close()
        except OSError:
            pass
