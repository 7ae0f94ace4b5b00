"""The signals both sides agree on, and how a process asks to die with its parent.

Standard library only: the kernel (which sends them) and the ranks (which handle them) import it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

__all__ = ["PARENT_DIED_SIGNAL", "STACK_DUMP_SIGNAL", "CUT_SIGNAL", "COLLECTIVES_SIGNAL", "STOP_POINT_SIGNAL",
           "RANK_THREAD_SIGNALS", "set_pdeathsig",
           "tie_to_kernel", "dump_signal_held"]

# prctl(2)'s option number: ask the kernel for a signal when the parent thread dies.


PR_SET_PDEATHSIG = 1


# A signal no library uses, so that our "parent died" handler is never someone else's.
PARENT_DIED_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else signal.SIGTERM


# faulthandler dumps every thread's stack into the rank's log on this one (a timeout, %dist_stacks).
# A real-time one: SIGUSR1 belongs to the user and their libraries (Lightning's Slurm requeue
# handler, say), whose handler would either be replaced by the dump or run by %dist_stacks.
STACK_DUMP_SIGNAL = signal.SIGRTMIN + 9 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR1


# A session rank stuck in a collective cuts its own group connections on this one (a thread of
# its own waits for it with sigwait: the main thread may be inside C code). Blocked in every
# thread of every rank from the start, so it is never delivered anywhere else.
CUT_SIGNAL = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None

# A session rank writes the collectives it waits in (its flight recorder) into the running cell's
# dir on this one; the same thread as the cut's takes it, blocked everywhere else the same way.
COLLECTIVES_SIGNAL = signal.SIGRTMIN + 7 if hasattr(signal, "SIGRTMIN") else None

# A stop that every rank obeys at the same collective (nbdist.worker.stop_point): the first one asks
# a busy rank for its collective counts, the second says the point. The same thread takes it.
STOP_POINT_SIGNAL = signal.SIGRTMIN + 8 if hasattr(signal, "SIGRTMIN") else None

# What that thread waits for, blocked in every other thread of a rank from its start.
RANK_THREAD_SIGNALS = {CUT_SIGNAL, COLLECTIVES_SIGNAL, STOP_POINT_SIGNAL} if CUT_SIGNAL is not None else set()


def set_pdeathsig(sig: int) -> bool:
    """Ask the kernel to send ``sig`` when our parent (thread) dies. Linux only."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def tie_to_kernel(kernel_pid: int, pdeathsig: bool) -> int | None:
    """A kernel's helper process (warm template, store host): die with the kernel; return its pidfd.

    PDEATHSIG follows the *thread* that started us, so it is asked for only where the kernel's main
    thread did (``pdeathsig``), and the returned pidfd is for the caller to watch in any case.
    None: the kernel died before we got here.
    """
    if pdeathsig:
        set_pdeathsig(signal.SIGKILL)
    if os.getppid() != kernel_pid:
        return None
    return os.pidfd_open(kernel_pid)


@contextlib.contextmanager
def dump_signal_held():
    """Hold STACK_DUMP_SIGNAL in this thread (and so in every process it starts) for the block.

    A new rank inherits the held signal: a timeout that expires while the rank is still starting
    leaves the signal pending instead of killing the rank by its default action, and the rank
    dumps its stack as soon as its handler is in (:func:`nbdist.worker.bootstrap.prepare_rank_process`).
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_DUMP_SIGNAL})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
