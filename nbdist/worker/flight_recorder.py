"""A session rank's flight recorder: its last collectives on every group, and the check that the
ranks call the same one.

Every collective of a re-formable group passes through :func:`record` (the group's forwarding,
:mod:`nbdist.worker.reformable_groups`): group, sequence number, op, the shapes and dtypes of its
tensors, the root or peer, when it started and when its work completed. Each group keeps its last
:data:`KEEP` in a ring. What a rank waits in is the oldest one that has not completed; the kernel
reads it through :func:`write_open_collectives`, which the rank's signal thread calls when asked
(its main thread may be inside C code, waiting for that very collective).

The check (``--check-collectives``) does before each collective what torch's
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does at start: every rank puts the collective's fingerprint
(op, group, sequence number, shapes, dtypes, root) into the group's store and compares it with its
peers' before it issues anything. A mismatch raises :class:`CollectiveMismatchError` on every rank
at once, naming each rank's call, and no rank issued the collective: the groups stay in step.

NCCL has a recorder of its own (torch's Flight Recorder): this one sees every backend at the Python
level, where the group's forwarding is, and the report adds what torch's says of the NCCL
collectives still open on the GPU (:mod:`nbdist.worker.torch_flight_recorder`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field

__all__ = ["KEEP", "Collective", "CollectiveMismatchError", "record", "watch_work", "abandon", "check_collective",
           "checking", "open_collectives", "recent_collectives", "write_open_collectives", "describe_collective"]

KEEP = 64  # collectives kept per group
# The Python API's names, for messages (the group's methods are the C++ ones).
_API_NAMES = {"allreduce": "all_reduce", "allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
              "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter_tensor",
              "alltoall_base": "all_to_all_single", "alltoall": "all_to_all"}
_POINT_TO_POINT = ("send", "recv", "recv_anysource")
# Ops whose tensors may legitimately differ across ranks (a root's list, uneven splits): only the
# op, the dtype and the root take part in their fingerprint.
_UNEVEN = ("gather", "scatter", "all_to_all", "all_to_all_single")  # by their API names


@dataclass
class Collective:
    """One collective as a rank issued it."""

    group: str
    seq: int
    op: str
    tensors: list = field(default_factory=list)  # "float32[3, 4]" per input tensor
    root: int | None = None  # broadcast, reduce, gather, scatter: the root; send/recv: the peer
    started: float = 0.0  # time.time()
    ended: float | None = None
    state: str = "waiting"  # waiting, done, failed, abandoned (its group was re-formed); issued: no future

    def fingerprint(self) -> tuple:
        tensors = sorted({t.split("[")[0] for t in self.tensors}) if self.op in _UNEVEN else self.tensors
        return (self.group, self.seq, self.op, tuple(tensors), self.root)


class CollectiveMismatchError(RuntimeError):
    """The ranks called different collectives (``--check-collectives`` found it before any was issued)."""


_RINGS: dict[str, collections.deque] = {}
_CHECKING: str | None = None  # the cell whose collectives are checked (its keys in the store)


def checking(cell: str | None) -> None:
    """Check every collective's fingerprint against the peers' for the cell ``cell`` (None: stop).

    The store keys are the cell's own: what a stopped or failed check left behind can never be
    read by a later cell's."""
    global _CHECKING
    _CHECKING = cell


def _tensors_of(args) -> list:
    """``dtype[shape]`` of the tensors among a collective's arguments (lists of them too)."""
    import torch

    out = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            out.append(f"{str(arg.dtype).removeprefix('torch.')}{list(arg.shape)}")
        elif isinstance(arg, (list, tuple)) and arg:
            out.extend(_tensors_of(arg))
    return out


def _root_of(op: str, args) -> int | None:
    if op in ("send", "recv"):
        return next((a for a in args if isinstance(a, int)), None)  # (tensors, peer, tag)
    if op == "recv_anysource":
        return None  # (tensors, tag): any peer
    opts = args[-1] if args else None
    return getattr(opts, "rootRank", None)


def record(group: str, seq: int, op: str, args) -> Collective:
    """Note that this rank issues ``op`` on ``group`` (its ``seq``-th collective there)."""
    name = _API_NAMES.get(op, op)
    inputs = args[1:2] if op in ("allgather", "_allgather_base", "allgather_coalesced") else args[:1]
    entry = Collective(group, seq, name, _tensors_of(inputs), _root_of(op, args), time.time())
    ring = _RINGS.get(group)
    if ring is None:
        ring = _RINGS[group] = collections.deque(maxlen=KEEP)
    ring.append(entry)
    return entry


def watch_work(entry: Collective, work) -> None:
    """Mark ``entry`` done (or failed) when its work completes, without waiting for it here.

    NCCL gives no work for a synchronous collective (torch 2.7+): the call returns once the
    collective is queued on the GPU, and the entry stays "issued". Only torch's own recorder then
    knows when the GPU is done with it (:func:`write_open_collectives` reads it)."""
    if work is None:
        entry.state = "issued"
        return

    def ended(future) -> None:
        entry.ended = time.time()
        try:
            future.value()  # raises the work's error, if it failed
            entry.state = "done"
        except Exception:
            entry.state = "failed"

    try:
        work.get_future().add_done_callback(ended)
    except Exception:  # a backend without futures: the entry stays "waiting" until the next one
        entry.state = "issued"


def check_collective(store, prefix: str, rank: int, size: int, entry: Collective, timeout: float) -> None:
    """Compare ``entry``'s fingerprint with every peer's through the group's store (keys under
    ``prefix``: one per generation of the group); raise :class:`CollectiveMismatchError` on every
    rank when they differ, before any rank issues it."""
    if _CHECKING is None or entry.op in _POINT_TO_POINT or size == 1:
        return
    prefix = f"{prefix}{_CHECKING}/"
    mine = f"{prefix}{entry.seq}/"
    store.set(f"{mine}{rank}", json.dumps(asdict(entry)))
    keys = [f"{mine}{r}" for r in range(size)]
    deadline = time.monotonic() + timeout
    while True:  # in slices: the stop button's SIGINT is taken between them (a peer may never come)
        try:
            store.wait(keys, _timedelta(0.2))
            break
        except RuntimeError as exc:  # DistStoreError: a slice went by
            if time.monotonic() > deadline or "timeout" not in str(exc).lower():
                raise
    calls = {r: Collective(**json.loads(store.get(k))) for r, k in enumerate(keys)}
    with contextlib.suppress(Exception):  # every peer read seq-2's keys before it reached seq-1
        store.delete_key(f"{prefix}{entry.seq - 2}/{rank}")
    if len({c.fingerprint() for c in calls.values()}) > 1:
        entry.state, entry.ended = "failed", time.time()
        said = "; ".join(f"rank {r}: {describe_collective(c, numbered=False)}" for r, c in sorted(calls.items()))
        raise CollectiveMismatchError(f"the ranks called different collectives as collective #{entry.seq} of "
                                      f"{entry.group} ({said}); none of them was issued, the groups are in step")


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def abandon(group: str) -> None:
    """The group's connections were dropped: what it still waited in will never complete."""
    for entry in _RINGS.get(group, ()):
        if entry.state in ("waiting", "issued"):
            entry.state, entry.ended = "abandoned", time.time()


def recent_collectives(group: str | None = None) -> list[Collective]:
    """The kept collectives, oldest first (of one group, or of all)."""
    rings = [_RINGS.get(group, ())] if group is not None else list(_RINGS.values())
    return sorted((c for ring in rings for c in list(ring)), key=lambda c: c.started)


def open_collectives() -> list[Collective]:
    """The collectives this rank issued and that have not completed, oldest first."""
    return [c for c in recent_collectives() if c.state in ("waiting", "issued")]


def describe_collective(c: Collective, numbered: bool = True, now: float | None = None) -> str:
    """``all_reduce #12 float32[3] on the default group`` (``, waiting 2.1 s`` when it is open and
    ``now`` is given); without ``numbered``, the call alone (``all_reduce float32[3]``)."""
    text = c.op + (f" #{c.seq}" if numbered else "")
    if c.tensors:
        text += " " + ", ".join(c.tensors[:3]) + (f" (+{len(c.tensors) - 3})" if len(c.tensors) > 3 else "")
    if c.root is not None:
        text += f" {'to' if c.op == 'send' else 'from' if c.op in ('recv', 'broadcast', 'scatter') else 'root'} rank {c.root}"
    if numbered:
        text += f" on {c.group}"
    if c.state in ("waiting", "issued") and now is not None:
        text += f", waiting {now - c.started:.1f} s"
    return text


def write_open_collectives(path: str, rank: int) -> None:
    """What this rank waits in (and its last collectives), for the kernel: JSON at ``path``."""
    from nbdist.protocol.rundir import write_private

    now = time.time()
    on_gpu = _torch_open_entries()
    waiting = open_collectives()
    if on_gpu is not None:  # NCCL: an "issued" call has returned; what the GPU still has, torch says
        waiting = [c for c in waiting if c.state == "waiting"]
    last = recent_collectives()[-3:]
    fingerprints = [json.dumps(c.fingerprint()) for c in waiting]
    if not waiting and on_gpu:  # only the GPU waits: compare the ranks by torch's entries
        fingerprints = [json.dumps(_torch_fingerprint(e)) for e in on_gpu]
    report = {"rank": rank, "pid": os.getpid(), "at": now,
              "open": [describe_collective(c, now=now) for c in waiting],
              "last": [describe_collective(c) + f" ({c.state})" for c in last],
              "fingerprints": fingerprints,
              "torch": _describe_torch_entries(on_gpu or [])}
    write_private(path, json.dumps(report).encode())


def _torch_open_entries() -> list[dict] | None:
    """torch's Flight Recorder entries of the NCCL collectives not completed yet; None where it has
    nothing to say (no NCCL group, or its recorder switched off)."""
    from nbdist.worker import torch_flight_recorder as torch_fr

    try:
        return torch_fr.read_nccl_entries() if torch_fr.nccl_in_use() and torch_fr.recorder_on() else None
    except Exception:  # the report must come whatever torch's dump does
        return None


def _torch_fingerprint(entry: dict) -> tuple:
    return (entry.get("pg_id"), entry.get("collective_seq_id"), entry.get("profiling_name"),
            entry.get("input_sizes"), entry.get("input_dtypes"))


def _describe_torch_entries(entries: list[dict]) -> list[str]:
    from nbdist.worker import torch_flight_recorder as torch_fr

    now_ns = time.time_ns()
    return [torch_fr.describe_torch_entry(e, now_ns) for e in entries[:3]]
