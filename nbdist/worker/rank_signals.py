"""A session rank's signal thread: what the kernel asks of a rank whose main thread may be inside C.

The kernel can't ask a busy rank anything on its channel (the main thread runs the cell, perhaps
waiting in a collective in C), so it sends a signal that one thread of the rank waits for with
``sigwait`` (blocked in every other thread from the rank's start, so no handler ever needs the main
thread): cut the groups' connections, write what the rank waits in, or agree a stop point
(:mod:`nbdist.worker.stop_point`). Each acts only for the cell the main thread still runs, and only
if that cell's dir holds the kernel's request: a signal that comes late can't touch the next cell.
Standard library; torch only where the rank made a process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from nbdist.protocol.session_channel import COLLECTIVES_FILE, CUT_REQUEST, STOP_COUNTS_FILE, STOP_POINT_FILE, STOP_REQUEST

__all__ = ["RunningCell", "answer_signals", "stop_asked", "torch_groups_in_use"]


def stop_asked(cell_dir: str | None) -> bool:
    """Whether the kernel asked to stop the cell in ``cell_dir`` (it writes the request before the signal)."""
    return cell_dir is not None and os.path.exists(os.path.join(cell_dir, STOP_REQUEST))


def torch_groups_in_use() -> bool:
    """Whether this rank made a process group (a session without one never imports torch here)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


class RunningCell:
    """The cell this rank's main thread runs, as the cut thread may see it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.cell_id: int | None = None
        self.cell_dir: str | None = None

    def enter(self, cell_id: int, cell_dir: str) -> None:
        with self.lock:
            self.cell_id, self.cell_dir = cell_id, cell_dir

    def leave(self) -> None:
        from nbdist.worker import stop_point

        with self.lock:  # never while a cut is under way: the groups it cuts are this cell's
            self.cell_id = self.cell_dir = None
            stop_point.end_cell()


def answer_signals(running: RunningCell, rank: int) -> None:
    """A thread that waits for the kernel's signals (blocked everywhere else, so no polling and no
    handler that would need the main thread, which may be stuck in C):

    - CUT_SIGNAL: cut the groups' connections. Only while the main thread still runs the cell the
      kernel asked about (its dir holds the request): a signal that comes late, once the cell is
      over and the groups perhaps re-formed, must not cut the new ones.
    - COLLECTIVES_SIGNAL: write what this rank waits in (its flight recorder) into the cell's dir.
    """
    from nbdist.protocol.signals import COLLECTIVES_SIGNAL, CUT_SIGNAL, RANK_THREAD_SIGNALS, STOP_POINT_SIGNAL

    if CUT_SIGNAL is None:
        return
    on_device = False
    while True:
        sig = signal.sigwait(RANK_THREAD_SIGNALS)
        on_device = on_device or _use_rank_device()
        with running.lock:
            if running.cell_dir is None:
                continue
            if sig == STOP_POINT_SIGNAL:
                with contextlib.suppress(OSError):  # a cell dir gone: the kernel no longer waits
                    _answer_stop_point(running.cell_dir, rank)
                continue
            if sig == COLLECTIVES_SIGNAL:
                from nbdist.worker.flight_recorder import write_open_collectives

                with contextlib.suppress(OSError):  # a cell dir gone: the kernel no longer waits
                    write_open_collectives(os.path.join(running.cell_dir, COLLECTIVES_FILE.format(rank=rank)), rank)
                continue
            if not os.path.exists(os.path.join(running.cell_dir, CUT_REQUEST)) or not torch_groups_in_use():
                continue
            from nbdist.worker import reformable_groups

            cut = reformable_groups.cut_groups()
        print(f"nbdist: cut this rank's process group connections ({cut}): it was stuck in a collective when "
              f"the cell was stopped; the session re-forms them", file=sys.stderr, flush=True)


def _use_rank_device() -> bool:
    """This thread on the rank's own GPU, as its main thread is (``bind_device``): a CUDA device is
    per thread, and an NCCL abort or a flight-recorder read here would otherwise make a context on
    GPU 0, another rank's GPU (hundreds of MiB each). True once done (a device stays set for the
    thread); never raises: a CUDA error left by the stuck cell must not end the thread that frees it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    with contextlib.suppress(Exception):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK") or 0) % torch.cuda.device_count())
        return True
    return False


def _answer_stop_point(cell_dir: str, rank: int) -> None:
    """STOP_POINT_SIGNAL, for the running cell only if its dir holds the stop request: the first
    one closes the gate and reports this rank's counts, the next one opens it up to the point
    (:mod:`nbdist.worker.stop_point`). A rank without a process group reports no counts."""
    from nbdist.worker import stop_point

    if not stop_asked(cell_dir):
        return
    counts_path = os.path.join(cell_dir, STOP_COUNTS_FILE.format(rank=rank))
    groups, recent = [], []
    if torch_groups_in_use() and "nbdist.worker.reformable_groups" in sys.modules:
        from nbdist.worker import flight_recorder, reformable_groups

        groups, recent = reformable_groups.peek_groups(), flight_recorder.recent_collectives()
    if not stop_point.report_counts(cell_dir, counts_path, rank, groups, recent):
        stop_point.load_point(cell_dir, os.path.join(cell_dir, STOP_POINT_FILE))
