"""Where each rank says it started and when it reached the user's code: one file per rank.

A rank writes ``ranks/{R}.pid`` ("pid host") as it starts and ``ranks/{R}.running`` once it is past
its startup (imports, process group). Each is written whole, to a temporary name, then renamed:
a reader sees nothing or all of it, on a local disk as on NFS. Ranks once appended lines to shared
``pids``/``running`` files with ``O_APPEND``, which NFS does not make atomic: two hosts' lines
could overwrite each other, and a lost line left a slot "still starting" and marked a good run
failed. A rank that registers again (a re-formed or healed rank) replaces its own file.

Standard library only: the ranks read this before torch.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from nbdist.protocol.rundir import write_private

__all__ = ["RANKS_DIR", "RankPid", "record_pid", "record_running", "read_running", "read_rank_pids", "read_pids"]

RANKS_DIR = "ranks"
_PID, _RUNNING = ".pid", ".running"


def _ranks_dir(run_dir: str, create: bool = False) -> str:
    path = os.path.join(run_dir, RANKS_DIR)
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    return path


def record_pid(run_dir: str, rank: int, pid: int) -> None:
    """Say that ``rank`` runs as ``pid`` on this host: a pid means nothing without its host (a rank of
    another machine may share a number with an unrelated process here)."""
    path = os.path.join(_ranks_dir(run_dir, create=True), f"{int(rank)}{_PID}")
    write_private(path, f"{int(pid)} {socket.gethostname()}\n".encode())


def record_running(run_dir: str, rank: int) -> None:
    """The rank is past its startup (imports, process group) and in the user's code."""
    write_private(os.path.join(_ranks_dir(run_dir, create=True), f"{int(rank)}{_RUNNING}"), b"")


def _rank_files(run_dir: str, suffix: str) -> list[tuple[int, str]]:
    """``(rank, path)`` of every ``ranks/{R}{suffix}``; temporary files and strangers ignored."""
    folder = _ranks_dir(run_dir)
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        stem, dot, rest = name.partition(".")
        if dot and "." + rest == suffix and stem.isdigit():
            out.append((int(stem), os.path.join(folder, name)))
    return out


def read_running(run_dir: str) -> set[int]:
    """Ranks that reached the user's code (the others were still starting)."""
    return {rank for rank, _ in _rank_files(run_dir, _RUNNING)}


@dataclass(frozen=True)
class RankPid:
    """Where a rank runs: its pid, and the host that pid belongs to."""

    pid: int
    host: str

    @property
    def local(self) -> bool:
        """On this machine: the only pids that may be signalled or looked up here."""
        return self.host in ("", socket.gethostname())


def read_rank_pids(run_dir: str) -> dict[int, RankPid]:
    """rank -> :class:`RankPid`, as the ranks recorded themselves (on any host)."""
    out = {}
    for rank, path in _rank_files(run_dir, _PID):
        try:
            with open(path) as fh:
                parts = fh.read().split()
        except OSError:  # replaced or removed as we read: the next read sees it
            continue
        if len(parts) in (1, 2) and parts[0].isdigit():
            out[rank] = RankPid(int(parts[0]), parts[1] if len(parts) == 2 else "")
    return out


def read_pids(run_dir: str) -> dict[int, int]:
    """rank -> pid of the ranks that run on this machine (the pids this machine may signal)."""
    return {rank: where.pid for rank, where in read_rank_pids(run_dir).items() if where.local}
