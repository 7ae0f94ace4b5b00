"""What a view shows of a rank's process beside its output: its memory (psutil)."""

from __future__ import annotations

import psutil

__all__ = ["rank_memory"]


def rank_memory(pid) -> int:
    """Resident memory of a rank and its children (DataLoader workers count too)."""
    try:
        proc = psutil.Process(pid)
        return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
    except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError, ValueError):
        return 0


