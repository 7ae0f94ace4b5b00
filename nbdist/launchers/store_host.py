"""The kernel's handle on its store host, the process that hosts each loopback run's rendezvous store.

So the kernel never imports torch for a loopback run or session (:mod:`nbdist.warmstart.store_host`
is the process itself). Started at ``%load_ext nbdist``, or at the first need of a process that
hasn't imported torch; it imports torch while the user writes the first cell. It is a fallback
away from the old way: where it can't serve (it died, it failed, it didn't answer), the kernel
hosts the store itself as it always did, importing torch, and says why once.

Like the warm template, it carries a marker (``NBDIST_RUN_ID=store-...``) so ``nbdist.ps()`` lists
it and ``nbdist.kill()`` stops it, its control channel is a socketpair inherited by it alone
(nothing listens), and it dies with the kernel.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from nbdist.protocol import rundir
from nbdist.protocol.marker import reserve_marker_env
from nbdist.protocol.rundir import STORE_HOST_PREFIX
from nbdist.warmstart.handle import tell_once

__all__ = ["StoreHost", "StoreHostUnavailable", "start_store_host", "current_store_host", "host_store",
           "cuda_device_count", "close_store_hosts", "STORE_HOST_ENV"]

STORE_HOST_ENV = "NBDIST_STORE_HOST"  # "0": the kernel hosts every store itself, as before
_ENTRY = "import sys; from nbdist.warmstart.store_host import main; sys.exit(main())"
# A first cell waits for a host still importing torch rather than import torch here: the host
# started earlier, so it is always the sooner of the two. Past this, the kernel hosts it itself.
START_WAIT_S = 60.0
REPLY_WAIT_S = 10.0  # opening a store takes a millisecond; past this the host is taken for stuck

_LOCK = threading.Lock()
_CURRENT: StoreHost | None = None


class StoreHostUnavailable(RuntimeError):
    """The store host can't open a store now; the message says why. The kernel hosts it itself."""


class StoreHost:
    """A running store host and the kernel's end of its control channel.

    ``status``: "starting", "ready" or "dead" (``reason`` says why).
    """

    def __init__(self, runs_root=None):
        self.run_id = STORE_HOST_PREFIX + rundir.new_run_id()
        self.run_dir = rundir.create_run_dir(self.run_id, runs_root)
        log_path = os.path.join(self.run_dir, "store_host.log")
        # ps tells a store host whose kernel is gone (a leftover) from one that serves a live kernel.
        rundir.write_private(os.path.join(self.run_dir, "kernel.pid"), str(os.getpid()).encode())
        self.status, self.reason, self.info = "starting", None, {}
        self.started = time.monotonic()
        self._lock = threading.Lock()  # one request and its reply at a time on the channel
        mine, theirs = socket.socketpair()
        env = reserve_marker_env(dict(os.environ), self.run_id, self.run_dir)
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # importing torch must not create a CUDA context
        # nbdist as this kernel imports it (a source tree on sys.path, say), whatever the host's cwd.
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        if threading.current_thread() is threading.main_thread():
            env["NBDIST_STORE_HOST_PDEATHSIG"] = "1"  # PDEATHSIG follows the thread that started it
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            # cwd "/": ``python -c`` puts the cwd first on sys.path, and the notebook's folder may
            # hold a module named like one the host imports.
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, stdout=log_fd,
                stderr=subprocess.STDOUT, start_new_session=True, cwd="/")
        finally:
            os.close(log_fd)
            theirs.close()
        self._conn = Connection(mine.detach())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __repr__(self) -> str:
        return f"<nbdist.StoreHost pid={self.pid} {self.status}>"

    def poll_ready(self, timeout: float = 0.0) -> bool:
        """Take the host's "ready" message if it came (waiting up to ``timeout``); True when it serves."""
        with self._lock:
            if self.status == "starting":
                try:
                    if self._conn.poll(timeout):
                        _, self.info = self._conn.recv()
                        self.status = "ready"
                except (EOFError, OSError):
                    self._mark_dead()
            if self.status != "dead" and self.proc.poll() is not None:
                self._mark_dead()
            return self.status == "ready"

    def wait_ready(self, timeout: float) -> bool:
        """Block until the host serves, died, or ``timeout`` passes; True when it serves."""
        deadline = time.monotonic() + timeout
        while self.status == "starting" and time.monotonic() < deadline:
            self.poll_ready(min(0.5, max(0.0, deadline - time.monotonic())))
        return self.poll_ready()

    def _mark_dead(self, why: str | None = None) -> None:
        code = self.proc.poll()
        self.status = "dead"
        self.reason = why or (f"the store host (pid {self.pid}) exited"
                              + (f" with code {code}" if code is not None else ""))

    def open(self, world_size: int, timeout: float = REPLY_WAIT_S) -> int:
        """A new store for ``world_size`` ranks on 127.0.0.1; return its port."""
        if not self.poll_ready():
            raise StoreHostUnavailable(self.describe())
        with self._lock:
            try:
                self._conn.send(("open", world_size))
                if not self._conn.poll(timeout):
                    # A late reply would answer the next request: this channel is done.
                    self._mark_dead(f"the store host (pid {self.pid}) did not answer within {timeout:g} s")
                    self._conn.close()
                    raise StoreHostUnavailable(self.reason)
                kind, body = self._conn.recv()
            except (EOFError, OSError):
                self._mark_dead()
                raise StoreHostUnavailable(self.reason) from None
        if kind != "opened":
            raise StoreHostUnavailable(f"the store host could not open a store: {body}")
        return body

    def release(self, port: int) -> None:
        """Drop the store on ``port`` (its server stops); nothing to wait for."""
        with self._lock:
            if self.status != "ready":
                return
            try:
                self._conn.send(("close", port))
            except OSError:
                self._mark_dead()

    def describe(self) -> str:
        if self.status == "starting":
            return "the store host is still importing torch"
        if self.status == "ready":
            return f"the store host (pid {self.pid}) is ready"
        return self.reason or f"the store host is {self.status}"

    def close(self, timeout: float = 3.0) -> None:
        """End the host now, and the stores it holds with it."""
        with self._lock:
            self._conn.close()  # end-of-file: the host leaves its loop
            if self.status != "dead":
                self._mark_dead(f"the store host (pid {self.pid}) was closed")
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait()


def current_store_host() -> StoreHost | None:
    """This process's store host, or None."""
    return _CURRENT


def start_store_host(runs_root=None) -> StoreHost | None:
    """Start this process's store host unless one serves or starts, or ``NBDIST_STORE_HOST=0``; return it."""
    global _CURRENT
    if os.environ.get(STORE_HOST_ENV, "1") == "0":
        return None
    with _LOCK:
        if _CURRENT is None or _CURRENT.status == "dead" or _CURRENT.proc.poll() is not None:
            _CURRENT = StoreHost(runs_root)
        return _CURRENT


def host_store(world_size: int) -> tuple[int, object] | None:
    """A loopback store for ``world_size`` ranks in the store host: ``(port, release)``.

    None where the caller should host it itself: store hosts are off, torch is already imported
    here while the host is not ready yet (hosting here then costs nothing), or the host can't
    serve (said once). A host still importing torch is waited for, up to ``START_WAIT_S``: it
    started before this process would, so that is the sooner way to a store.
    """
    if os.environ.get(STORE_HOST_ENV, "1") == "0":
        return None
    torch_here = "torch" in sys.modules
    host = _CURRENT
    if host is None or not (host.poll_ready() or host.status == "starting"):
        if host is None and torch_here:
            return None  # a script or kernel that has torch anyway and never asked for a host
        if host is not None:  # it died: a new one serves the next runs
            tell_once(f"{host.describe()}; a new store host is starting"
                      + ("; the kernel hosts this run's store itself" if torch_here else ""))
        host = start_store_host()
        if host is None:
            return None
    if host.status == "starting":
        if torch_here:
            return None
        if not host.wait_ready(START_WAIT_S):
            tell_once(f"{host.describe()} after {START_WAIT_S:g} s; the kernel hosts this run's store itself")
            return None
    try:
        port = host.open(world_size)
    except StoreHostUnavailable as exc:
        tell_once(f"{exc}; the kernel hosts this run's store itself")
        return None
    return port, lambda: host.release(port)


def cuda_device_count() -> int | None:
    """The GPUs this process's ranks would see, as the store host counted them; None where it can't tell.

    It can't where no host serves or starts, or ``CUDA_VISIBLE_DEVICES`` changed since it started. A
    host still importing torch is waited for, as :func:`host_store` does.
    """
    host = _CURRENT
    if host is None or "torch" in sys.modules:
        return None
    if not host.wait_ready(START_WAIT_S):
        return None
    info = host.info
    if "cuda_device_count" not in info or info.get("cuda_visible_devices") != os.environ.get("CUDA_VISIBLE_DEVICES"):
        return None
    return int(info["cuda_device_count"])


def close_store_hosts() -> None:
    """End this process's store host now: what the kernel does last as it exits, after its runs."""
    global _CURRENT
    with _LOCK:
        host, _CURRENT = _CURRENT, None
    if host is not None:
        try:
            host.close()
        except Exception:
            pass
