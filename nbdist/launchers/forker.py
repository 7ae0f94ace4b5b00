"""The one thread that starts every process of nbdist's launchers, so that each one dies with the kernel.

``PR_SET_PDEATHSIG`` fires when the *thread* that forked a child ends, not when its process does. A
session starts its ranks from a thread of its own, a timer or a view's button from others: an
engine (torchrun's agent, mpiexec, srun) started there would outlive a SIGKILLed kernel, holding
its GPUs, or be killed the moment that thread ends. So every start goes through this thread, which
lives as long as the kernel: a daemon thread, never joined, blocked on its queue. It dies only with
the process (after the atexit handlers, which close sessions and runs gracefully first).

``concurrent.futures.ThreadPoolExecutor`` would not do: its workers are joined when the interpreter
shuts down, before the atexit handlers, which would fire PDEATHSIG on everything they started
before the sessions could close their ranks gracefully.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

__all__ = ["call_in_forker", "is_forker_thread", "START_TIMEOUT_S"]

START_TIMEOUT_S = 120.0  # starting processes takes milliseconds; a start this slow is stuck

_QUEUE: queue.SimpleQueue = queue.SimpleQueue()
_LOCK = threading.Lock()
_THREAD: threading.Thread | None = None


def _serve() -> None:
    while True:
        fn, args, kwargs, future = _QUEUE.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # the caller re-raises it, in its own thread
            future.set_exception(exc)


def _ensure_thread() -> None:
    global _THREAD
    with _LOCK:
        if _THREAD is None or not _THREAD.is_alive():
            _THREAD = threading.Thread(target=_serve, name="nbdist-forker", daemon=True)
            _THREAD.start()


def is_forker_thread() -> bool:
    """Whether this is the thread that starts nbdist's processes (PDEATHSIG holds for its children)."""
    return threading.current_thread() is _THREAD


def call_in_forker(fn, *args, timeout: float = START_TIMEOUT_S, **kwargs):
    """Run ``fn(*args, **kwargs)`` on the forker thread; return its value or raise its exception.

    A KeyboardInterrupt while waiting lets the start finish first (it takes milliseconds), so
    that the caller's start-or-close can stop everything it started, then propagates.

    Examples
    --------
    >>> call_in_forker(launcher.start, run_dir, run_id, nprocs, env)
    """
    if is_forker_thread():
        return fn(*args, **kwargs)
    _ensure_thread()
    future: Future = Future()
    _QUEUE.put((fn, args, kwargs, future))
    try:
        return future.result(timeout)
    except KeyboardInterrupt:
        try:
            future.result(timeout)
        except BaseException:  # noqa: BLE001 - its own failure is not news: the interrupt is
            pass
        raise
