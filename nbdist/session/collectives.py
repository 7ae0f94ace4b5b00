"""Which collective each rank of a session waits in, asked of the ranks' flight recorders.

A rank stuck in a collective can't answer on its channel (its main thread waits in C code), so
the kernel sends it COLLECTIVES_SIGNAL: the rank's signal thread writes what its recorder holds
(:mod:`nbdist.worker.flight_recorder`) into the running cell's dir, and the kernel reads it back
within a deadline. The words go into every message about a stopped or stuck cell, and beside each
stack in ``%dist_stacks``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from nbdist.protocol.session_channel import COLLECTIVES_FILE
from nbdist.protocol.signals import COLLECTIVES_SIGNAL

__all__ = ["ask_open_collectives", "describe_open_collectives"]

_POLL_S = 0.01


def ask_open_collectives(inc, cell, ranks=None, timeout: float = 0.5) -> dict[int, dict]:
    """``{rank: report}`` of the local ``ranks`` (default: the cell's busy ones) that answered within
    ``timeout``. A report has ``open``: what the rank waits in, oldest first; ``last``: its last
    collectives; ``torch``: what torch's Flight Recorder says of its open NCCL collectives. A rank
    that ends its part of the cell meanwhile is not waited for: it has no cell to answer about."""
    ranks = cell.busy_ranks() if ranks is None else ranks
    cell_dir = cell.cell_dir
    if COLLECTIVES_SIGNAL is None:
        return {}
    local = [r for r in sorted(ranks) if r in inc.pids and r not in inc.remote]
    paths = {r: os.path.join(cell_dir, COLLECTIVES_FILE.format(rank=r)) for r in local}
    asked = time.time()
    for pid in inc.local_pids(local):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, COLLECTIVES_SIGNAL)
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    while len(reports) < len(paths) and time.monotonic() < deadline:
        busy = set(cell.busy_ranks())
        for rank, path in list(paths.items()):
            if rank in reports:
                continue
            if rank not in busy:  # answered the cell meanwhile: its file may never come
                paths.pop(rank)
                continue
            with contextlib.suppress(OSError, ValueError):
                with open(path, "rb") as fh:
                    report = json.load(fh)
                if report.get("at", 0) >= asked - 0.05:  # this request's answer, not an earlier one's
                    reports[rank] = report
        if len(reports) < len(paths):
            time.sleep(_POLL_S)
    return reports


def describe_open_collectives(reports: dict[int, dict]) -> str:
    """``rank 0: all_reduce #3 float32[4] on the default group, waiting 0.6 s; rank 1: in no
    collective: the ranks called different collectives`` (empty when no rank answered)."""
    if not reports:
        return ""
    parts = []
    for rank, report in sorted(reports.items()):
        on_gpu = report.get("torch")  # NCCL: where the GPU is with it, from torch's own recorder
        if report["open"]:
            part = report["open"][0] + (f" (on the GPU, per torch's NCCL flight recorder: {on_gpu[0]})"
                                        if on_gpu else "")
        else:  # NCCL's Python call returns once queued: only the GPU still has it
            part = f"on the GPU, {on_gpu[0]} (torch's NCCL flight recorder)" if on_gpu else "in no collective"
        parts.append(f"rank {rank}: {part}")
    waiting = {rank: r["fingerprints"][0] for rank, r in reports.items() if r["open"]}
    text = "; ".join(parts)
    if len(set(waiting.values())) > 1:
        return text + ": the ranks called different collectives"
    idle = sorted(r for r, report in reports.items() if not report["open"] and not report.get("torch"))
    if waiting and idle:
        return text + f": {'rank' if len(idle) == 1 else 'ranks'} {', '.join(map(str, idle))} never joined"
    return text
