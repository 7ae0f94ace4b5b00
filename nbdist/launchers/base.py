"""The launcher contract: how a run's ranks start, and what the run asks of them afterwards.

Launchers differ only in how ranks start (docs/contributing.md): spawned or forked by the kernel
(:mod:`.spawn`), or started by an engine (:mod:`.engine`: torchrun, mpirun, srun). Everything after
the start is the run's own (:mod:`nbdist.run.monitor`, :mod:`nbdist.run.ending`), and this is all it
asks. jupyter_client's kernel provisioners are the model: the abstract methods are what each
launcher must say for itself; the others have the answer most launchers give.
"""

from __future__ import annotations

import abc

__all__ = ["Launcher"]


class Launcher(abc.ABC):
    """Start ``nprocs`` ranks of this node and follow them: pids, exits, what to signal to stop them.

    Ranks are named by their slot on this node (0..nprocs-1); the run maps slots to global ranks.
    """

    name = "launcher"
    nnodes = 1  # kernels (or engines' nodes) that make the world
    node_rank = 0  # this node's place among them
    hosts_rendezvous = True  # the ranks meet at a store the kernel hosts (False: the engine brings its own)
    remote_ranks = False  # ranks may run on other machines (the kernel then opens an output channel)

    @abc.abstractmethod
    def start(self, run_dir: str, run_id: str, nprocs: int, env: dict[str, str]) -> None:
        """Start the ranks (on the forker thread: :mod:`nbdist.launchers.forker`)."""

    @property
    @abc.abstractmethod
    def pids(self) -> dict[int, int]:
        """slot -> pid of each rank known so far."""

    @abc.abstractmethod
    def poll(self) -> dict[int, int | None]:
        """slot -> exit code, or None while the rank runs (a signal as -N)."""

    @abc.abstractmethod
    def collect_exited(self, run_dir: str, known: set[int]) -> dict[int, int]:
        """Ranks (not in ``known``) that exited since the last call -> exit code."""

    @abc.abstractmethod
    def leaders(self) -> list[int]:
        """The pids a stop signals first (each leads the group of what it started), on this machine only."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the launcher holds once its ranks are gone."""

    def world_size_for(self, nprocs: int) -> int:
        """The whole world's size when this node starts ``nprocs`` ranks."""
        return self.nnodes * nprocs

    def spans_nodes(self) -> bool:
        """Whether ranks may land on other machines (then they must reach the kernel's address)."""
        return False

    def sentinels(self) -> list:
        """What the monitor may wait on to wake when a rank exits (nothing: it looks every tick)."""
        return []

    def remote_slots(self) -> set[int]:
        """Slots whose rank runs on another machine: their pids are never looked up or signalled here."""
        return set()

    def exit_report(self) -> tuple[dict[int, int], int | None]:
        """``({slot: exit code}, root-cause slot)`` as the engine reported them, where it does."""
        return {}, None

    def wait_for_engine(self, timeout: float) -> None:
        """Let an engine that reports its ranks' exits (torchrun) notice a failure and end by itself."""

    def engine_log(self) -> str:
        """The last lines the engine printed (nothing, without an engine)."""
        return ""
