"""How the kernels of an attached world talk to each other: in rounds, and signed.

An attached kernel is a rank of a torchrun, MPI or Slurm world for its whole life. Each launch in it
is a *round*, numbered alike on every kernel because every kernel runs the same cells in the same
order. A round's messages live under its own topic (``attach/7``), so no kernel ever reads another
round's keys, and a kernel whose cell ended early (a stop, ``sys.exit``) still takes part in the
round's gather: the counters never drift apart.

Three transports, one interface (``allgather``, ``bcast``, ``post_stop``, ``stop_posted``):

* :class:`StoreComm`, a TCPStore (torchrun's agent store, a Slurm step's store): every wait polls
  with a deadline, so a stop button reaches the kernel within a poll, and a kernel that posts a
  stop is seen by its peers' :class:`StopWatch` while their cells still run;
* :class:`MpiComm`, mpi4py's buffer collectives (never its pickling ones);
* :class:`TorchComm`, the world's own process group, through tensor collectives.

Every message is signed with the world's key (:mod:`nbdist.protocol.signing`) and checked before
anything of it is unpickled; ``key=None`` is the documented mode without a shared key.
"""

from __future__ import annotations

import _thread
import threading
import time

from nbdist.protocol.signing import UnsignedMessageError, dumps_signed, loads_signed

__all__ = ["StoreComm", "MpiComm", "TorchComm", "StopWatch", "next_round", "KernelCommTimeout"]

POLL_S = 0.05  # how often a waiting kernel looks at the store: a stop reaches it within this
WATCH_S = 0.2  # how often a running cell's watch looks for a peer's stop
_ROUNDS = {"n": 0}


class KernelCommTimeout(TimeoutError):
    """A round's peers did not answer within the deadline; names the kernels that were missing."""


def next_round(kind: str = "attach") -> str:
    """The next round's topic, the same on every kernel that runs the same launches in order."""
    _ROUNDS["n"] += 1
    return f"{kind}/{_ROUNDS['n']}"


class StoreComm:
    """Rounds between the kernels over a TCPStore (no process group needed).

    Parameters
    ----------
    store : torch.distributed.Store
    rank, size : int
        This kernel's place in the world of kernels.
    key : bytes or None
        The world's signing key; None sends plain pickles (no shared key).
    timeout : float
        Seconds a gather waits for its slowest peer.
    """

    def __init__(self, store, rank: int, size: int, key: bytes | None = None, timeout: float = 300.0):
        self.store, self.rank, self.size, self.key, self.timeout = store, rank, size, key, timeout
        self.refused: list[str] = []  # stop keys that failed their signature: named, never obeyed

    def with_key(self, key: bytes | None) -> "StoreComm":
        return StoreComm(self.store, self.rank, self.size, key, self.timeout)

    def _wait(self, keys: list[str], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                missing = [k for k in keys if not self.store.check([k])]
                raise KernelCommTimeout(f"{what}: no answer within {self.timeout:.0f} s from {', '.join(missing)}")
            time.sleep(POLL_S)  # a Ctrl-C lands here, not after a C++ wait of minutes

    def allgather(self, value, topic: str) -> list:
        """Every kernel's ``value``, in rank order, on every kernel."""
        prefix = f"nbdist/{topic}/gather/"
        self.store.set(prefix + str(self.rank), dumps_signed(self.key, value, topic=topic, sender=self.rank))
        keys = [prefix + str(r) for r in range(self.size)]
        self._wait(keys, f"the kernels' gather of {topic}")
        return [loads_signed(self.key, self.store.get(k), topic=topic, sender=r) for r, k in enumerate(keys)]

    def bcast(self, value, topic: str, root: int = 0):
        """``root``'s value on every kernel."""
        key = f"nbdist/{topic}/bcast"
        if self.rank == root:
            self.store.set(key, dumps_signed(self.key, value, topic=topic, sender=root))
        self._wait([key], f"kernel {root}'s broadcast of {topic}")
        return loads_signed(self.key, self.store.get(key), topic=topic, sender=root)

    def post_stop(self, topic: str, what: str) -> None:
        """Tell the other kernels that this kernel's cell of ``topic`` was stopped (``what`` ended it)."""
        self.store.set(f"nbdist/{topic}/stop/{self.rank}",
                       dumps_signed(self.key, what, topic=topic + "/stop", sender=self.rank))

    def stop_posted(self, topic: str) -> tuple[int, str] | None:
        """``(kernel, what)`` of a peer that posted a stop in ``topic``, or None."""
        for r in range(self.size):
            k = f"nbdist/{topic}/stop/{r}"
            if r == self.rank or k in self.refused or not self.store.check([k]):
                continue
            try:
                return r, loads_signed(self.key, self.store.get(k), topic=topic + "/stop", sender=r)
            except UnsignedMessageError:
                self.refused.append(k)  # an outsider's stop: not obeyed (the gather names its own)
        return None


class MpiComm:
    """Rounds over MPI with its buffer collectives: mpi4py's lowercase calls unpickle what arrives."""

    def __init__(self, comm, key: bytes | None = None):
        self.comm, self.key = comm, key
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def with_key(self, key: bytes | None) -> "MpiComm":
        return MpiComm(self.comm, key)

    def _allgather_bytes(self, data: bytes) -> list[bytes]:
        from mpi4py import MPI

        sizes = bytearray(8 * self.size)
        self.comm.Allgather([len(data).to_bytes(8, "little"), MPI.BYTE], [sizes, MPI.BYTE])
        counts = [int.from_bytes(sizes[8 * r:8 * r + 8], "little") for r in range(self.size)]
        offsets = [sum(counts[:r]) for r in range(self.size)]
        out = bytearray(sum(counts))
        self.comm.Allgatherv([data, MPI.BYTE], [out, counts, offsets, MPI.BYTE])
        return [bytes(out[o:o + c]) for o, c in zip(offsets, counts)]

    def allgather(self, value, topic: str) -> list:
        blobs = self._allgather_bytes(dumps_signed(self.key, value, topic=topic, sender=self.rank))
        return [loads_signed(self.key, b, topic=topic, sender=r) for r, b in enumerate(blobs)]

    def bcast(self, value, topic: str, root: int = 0):
        mine = dumps_signed(self.key, value, topic=topic, sender=root) if self.rank == root else b""
        return loads_signed(self.key, self._allgather_bytes(mine)[root], topic=topic, sender=root)

    def post_stop(self, topic: str, what: str) -> None:
        """MPI has no side channel that a busy peer could watch: the gather says it instead."""

    def stop_posted(self, topic: str):
        return None


class TorchComm:
    """Rounds over the world's process group, where there is neither MPI nor a store."""

    def __init__(self, rank: int, size: int, key: bytes | None = None):
        self.rank, self.size, self.key = rank, size, key

    def with_key(self, key: bytes | None) -> "TorchComm":
        return TorchComm(self.rank, self.size, key)

    @staticmethod
    def _ensure_group() -> None:
        import torch.distributed as dist

        if not dist.is_initialized():  # a launch with init_process_group=False still gathers
            dist.init_process_group(backend="gloo", init_method="env://")

    def allgather(self, value, topic: str) -> list:
        from nbdist.worker.signed_collectives import all_gather_signed

        self._ensure_group()
        return all_gather_signed(value, key=self.key, topic=topic)

    def bcast(self, value, topic: str, root: int = 0):
        from nbdist.worker.signed_collectives import broadcast_signed

        self._ensure_group()
        return broadcast_signed(value, key=self.key, topic=topic, src=root)

    def post_stop(self, topic: str, what: str) -> None:
        """No side channel: the gather says it."""

    def stop_posted(self, topic: str):
        return None


class StopWatch:
    """While this kernel's cell runs, watch for a peer's stop and interrupt the cell when one comes.

    ``disarm()`` ends the watch before the round's gather: the interrupt can only land in the cell,
    never in nbdist's own bookkeeping after it (both take the same lock).
    """

    def __init__(self, comm, topic: str):
        self.comm, self.topic = comm, topic
        self.by: tuple[int, str] | None = None
        self._lock, self._armed, self._done = threading.Lock(), True, threading.Event()
        self._thread = None
        if isinstance(comm, StoreComm) and threading.current_thread() is threading.main_thread():
            self._thread = threading.Thread(target=self._watch, name="nbdist-round-watch", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(WATCH_S):
            try:
                found = self.comm.stop_posted(self.topic)
            except Exception:  # a store that went away: the gather will say so, with its deadline
                return
            if found is not None:
                with self._lock:
                    if self._armed:
                        self.by, self._armed = found, False
                        _thread.interrupt_main()
                return

    def disarm(self) -> None:
        with self._lock:
            self._armed = False
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * WATCH_S + 1.0)
