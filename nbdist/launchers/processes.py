"""Whether a process is gone: what every launcher asks of its ranks' pids (psutil)."""

from __future__ import annotations

import psutil

__all__ = ["is_gone", "is_zombie"]


def is_gone(pid: int) -> bool:
    """A pid is gone when it no longer exists or is a zombie (it holds no memory, no GPU, no port)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return True


def is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
