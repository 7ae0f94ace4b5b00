"""Warm start, the kernel's side: one template per kernel, started, asked for ranks, refreshed.

The template (:mod:`nbdist.warmstart.template`) is a clean exec that imported torch; ranks forked from it
are ready in milliseconds. It is never on the critical path: until it is ready, or when it died
or can't serve (CUDA initialised by a preload, a module changed on disk), launches spawn as they
always did, and the reason is said once. It carries a marker like any nbdist process
(``NBDIST_RUN_ID=warm-...``), so ``nbdist.ps()`` lists it and ``nbdist.kill()`` stops it.

The control channel is a socketpair made here and inherited by the template alone: nothing
listens, so no other process can ask it for code execution.
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
from nbdist.protocol.rundir import TEMPLATE_PREFIX

__all__ = ["WarmTemplate", "WarmUnavailable", "warm", "current_template", "choose_start_method",
           "fork_ranks", "start_in_background", "close_templates", "retire_templates", "tell_once", "TEMPLATE_PREFIX"]

WARM_ENV = "NBDIST_WARM"  # "0" turns warm start off
START_METHOD_ENV = "NBDIST_START_METHOD"  # the default start method: auto, warm, spawn or fork
_ENTRY = "import sys; from nbdist.warmstart.template import main; sys.exit(main())"

_LOCK = threading.Lock()
_CURRENT: WarmTemplate | None = None
_RETIRING: list = []
_TOLD: set = set()


class WarmUnavailable(RuntimeError):
    """The template can't fork ranks now; the message says why. The launch spawns instead."""


def tell_once(message: str) -> None:
    """Say ``message`` on stderr (the cell's output in a notebook) the first time only."""
    if message not in _TOLD:
        _TOLD.add(message)
        print(f"nbdist: {message}", file=sys.stderr, flush=True)


class WarmTemplate:
    """A running template process and the kernel's end of its control channel.

    ``status``: "starting", "ready", "refused" (it can't serve, ``reason`` says why), "stale" (a
    module changed on disk), "retired" (replaced; it exits once its ranks are done) or "dead".
    """

    def __init__(self, preload=(), runs_root=None):
        self.preload = tuple(preload)
        self.run_id = TEMPLATE_PREFIX + rundir.new_run_id()
        self.run_dir = rundir.create_run_dir(self.run_id, runs_root)
        self.log_path = os.path.join(self.run_dir, "template.log")
        # ps tells a template whose kernel is gone (a leftover) from one that serves a live kernel.
        rundir.write_private(os.path.join(self.run_dir, "kernel.pid"), str(os.getpid()).encode())
        self.status, self.reason, self.info = "starting", None, {}
        self.started = time.monotonic()
        self.ready_after: float | None = None
        self._lock = threading.Lock()
        mine, theirs = socket.socketpair()
        env = reserve_marker_env(dict(os.environ), self.run_id, self.run_dir)
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # torch.cuda.is_available() without a CUDA context
        # Preload modules import as they would here (ranks get the kernel's sys.path at each launch).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        if threading.current_thread() is threading.main_thread():
            env["NBDIST_TEMPLATE_PDEATHSIG"] = "1"  # PDEATHSIG follows the thread that started it
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, str(theirs.fileno()), str(os.getpid()), *self.preload],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, stdout=log_fd,
                stderr=subprocess.STDOUT, start_new_session=True, cwd=os.getcwd())
        finally:
            os.close(log_fd)
            theirs.close()
        self._sock = mine
        self._conn = Connection(os.dup(mine.fileno()))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __repr__(self) -> str:
        return f"<nbdist.WarmTemplate pid={self.pid} {self.status} preload={list(self.preload)}>"

    def alive(self) -> bool:
        return self.proc.poll() is None and self.status not in ("dead", "retired")

    def poll_ready(self, timeout: float = 0.0) -> bool:
        """Take the template's "ready" message if it came (waiting up to ``timeout``); True when it serves."""
        if self.status == "starting":
            try:
                if self._conn.poll(timeout):
                    _, self.info = self._conn.recv()
                    self.ready_after = time.monotonic() - self.started
                    self.reason = self.info.get("refusal")
                    self.status = "refused" if self.reason else "ready"
            except (EOFError, OSError):
                self._mark_dead()
        if self.status in ("ready", "starting") and self.proc.poll() is not None:
            self._mark_dead()
        return self.status == "ready"

    def _mark_dead(self) -> None:
        code = self.proc.poll()
        self.status = "dead"
        self.reason = f"the warm template (pid {self.pid}) exited" + (f" with code {code}" if code is not None else "")

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the template serves, can't serve, or ``timeout`` passes; True when it serves."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.status == "starting":
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left <= 0:
                break
            self.poll_ready(left)
        return self.poll_ready()

    def fork(self, request: dict, timeout: float = 30.0):
        """Fork ``request["ranks"]``; return ``(pids by local rank, the run's connection)``."""
        with self._lock:
            if not self.poll_ready():
                raise WarmUnavailable(self.describe())
            ours, theirs = socket.socketpair()
            try:
                self._conn.send(("fork", request))
                socket.send_fds(self._sock, [b"F"], [theirs.fileno()])
            except OSError:
                ours.close()
                self._mark_dead()
                raise WarmUnavailable(self.describe()) from None
            finally:
                theirs.close()
        run_conn = Connection(ours.detach())
        try:
            if not run_conn.poll(timeout):
                raise WarmUnavailable(f"the warm template did not answer within {timeout:g} s")
            kind, body = run_conn.recv()
        except (EOFError, OSError):
            self._mark_dead()
            run_conn.close()
            raise WarmUnavailable(self.describe()) from None
        if kind != "started":
            run_conn.close()
            if "changed on disk" in body:
                self.status, self.reason = "stale", body
            raise WarmUnavailable(body)
        return body, run_conn

    def describe(self) -> str:
        if self.status == "starting":
            return "the warm template is still importing torch"
        if self.status == "ready":
            return f"the warm template (pid {self.pid}) is ready"
        return self.reason or f"the warm template is {self.status}"

    def retire(self) -> None:
        """Stop serving; the template exits once the ranks it forked are done (they die with it)."""
        self.status = "retired"
        try:
            self._conn.send(("retire", None))
        except OSError:
            pass
        _RETIRING.append(self)

    def close(self, timeout: float = 3.0) -> None:
        """End the template now. Ranks it forked die with it (PDEATHSIG), as they would with the kernel."""
        for closing in (self._conn, self._sock):
            closing.close()  # end-of-file: the template leaves its loop
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait()
        self.status = "dead" if self.status != "retired" else self.status


def current_template() -> WarmTemplate | None:
    """This kernel's template, or None."""
    return _CURRENT


def warm(preload=(), refresh: bool = False, wait: bool = False, timeout: float | None = None,
         runs_root=None) -> WarmTemplate:
    """Start this kernel's warm template, or refresh it; return it.

    A new template replaces the current one when there is none, when it died, can't serve or
    went stale, when ``preload`` names modules it lacks, or with ``refresh=True``. The old one
    stops serving and exits once its ranks are done.

    Parameters
    ----------
    preload : sequence of str
        Modules to import in the template besides torch (``"transformers"``): each rank then
        starts with them imported.
    refresh : bool
        Start a new template even if the current one serves (after ``pip install -U``, say).
    wait : bool
        Block until the template is ready (or can't serve).

    Examples
    --------
    >>> nbdist.warm(preload=("transformers",), wait=True)
    <nbdist.WarmTemplate pid=4242 ready preload=['transformers']>
    >>> nbdist.launch(fn, nprocs=4)      # ranks forked from the template
    """
    global _CURRENT
    with _LOCK:
        _prune_retired()
        old = _CURRENT
        if old is not None:
            old.poll_ready()
        keep = (old is not None and not refresh and old.status in ("starting", "ready")
                and set(preload) <= set(old.preload))
        if not keep:
            modules = tuple(dict.fromkeys((*(old.preload if old else ()), *preload)))
            _CURRENT = WarmTemplate(modules, runs_root)
            if old is not None and old.alive():
                old.retire()
        template = _CURRENT
    if wait:
        template.wait_ready(timeout)
    return template


def start_in_background() -> WarmTemplate | None:
    """What ``%load_ext nbdist`` does: start the template unless ``NBDIST_WARM=0``."""
    if os.environ.get(WARM_ENV, "1") == "0":
        return None
    # The kernel itself doesn't import torch: its store host (nbdist.launchers.store_host) holds the stores.
    return warm()


def choose_start_method(requested: str | None) -> str:
    """The start method of a launch: "warm" by default only when the template serves right now.

    ``None`` takes ``$NBDIST_START_METHOD`` (default "auto"). A template found dead or stale is
    restarted in the background, and this launch spawns.
    """
    requested = requested or os.environ.get(START_METHOD_ENV) or "auto"
    if requested != "auto":
        return requested
    template = _CURRENT
    if template is None:
        return "spawn"
    if template.poll_ready():
        return "warm"
    if template.status == "refused":
        tell_once(f"{template.reason}; starting the ranks with spawn")
    if template.status in ("dead", "stale") and os.environ.get(WARM_ENV, "1") != "0":
        tell_once(f"{template.describe()}; this launch spawns, and a new warm template is starting")
        warm()
    return "spawn"


def fork_ranks(request: dict, explicit: bool):
    """Fork the ranks of ``request`` from the template; ``explicit``: the user asked for "warm",
    so start the template if needed and wait for it. Raises WarmUnavailable."""
    template = warm() if explicit else _CURRENT
    if template is None:
        raise WarmUnavailable("no warm template is running")
    if explicit:
        template.wait_ready(120)
    try:
        return template.fork(request)
    except WarmUnavailable:
        if template.status == "stale":
            warm(refresh=True)
            raise WarmUnavailable(f"{template.reason}; a fresh template is starting") from None
        raise


def retire_templates() -> WarmTemplate | None:
    """Warm start off for this kernel: the template stops serving and exits once the ranks it forked
    (live sessions' and runs') have ended; it never takes them with it. Returns the one retired."""
    global _CURRENT
    with _LOCK:
        _prune_retired()
        template, _CURRENT = _CURRENT, None
    if template is not None and template.alive():
        template.retire()
    return template


def _prune_retired() -> None:
    for old in list(_RETIRING):
        if old.proc.poll() is not None:
            old.close()
            _RETIRING.remove(old)


def close_templates() -> None:
    """End every template of this process now, and the ranks they forked with them.

    What the kernel does last as it exits (:mod:`nbdist.run.at_exit`, after its sessions and runs
    ended gracefully). While sessions or runs live, :func:`retire_templates` is the polite way.
    """
    global _CURRENT
    for template in [*_RETIRING, *([_CURRENT] if _CURRENT else [])]:
        try:
            template.close()
        except Exception:
            pass
    _RETIRING.clear()
    _CURRENT = None
