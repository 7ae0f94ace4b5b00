"""Process groups that a session re-forms in place, so the user's models keep a working group.

A rank left in a collective that its peers will never join can't be freed by a signal (gloo and
NCCL wait in C++), and gloo's backend has no working ``abort()``: the only thing that releases it
is its peers closing their connections. A torch ``ProcessGroup`` also keeps the first backend it
was given for good (``_register_backend`` reuses the one already there), so a new backend can't be
swapped into the group that DDP, FSDP2's mesh and the user's code already hold.

So, as torchft's reconfigurable groups do, a session rank's groups are :class:`ReformableGroup`:
a Python ``ProcessGroup`` whose collectives forward to an inner torch group (gloo, and NCCL for
CUDA tensors where asked). The object that DDP and the mesh hold never changes; what it forwards
to does. :func:`release_groups` drops the inner groups (NCCL's are aborted first), which closes
their connections, and a peer stuck in a collective fails at once; :func:`reform_groups` connects
new inner groups under a fresh store prefix, in the order the groups were made (the same on every
rank, as ``new_group`` is collective). It is registered as the backend ``"nbdist"`` (``dist.get_backend()``
still names the wrapped one); groups made with ``new_group()`` are re-formable too, a group made
with an explicit ``backend="gloo"`` is not. One-shot runs don't use it.
"""

from __future__ import annotations

import os
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup as _CProcessGroup

from nbdist.protocol.session_channel import HEAL_GENERATION_ENV
from nbdist.worker import flight_recorder, stop_point
from nbdist.worker.group_replay import record_group_calls
from nbdist.worker.member_arrival import Reforming
from nbdist.worker.socket_cut import shut_down_sockets, socket_inodes
from nbdist.worker.model_reset import reset_models, track_ddp_models
from nbdist.worker.optimizer_steps import track_optimizer_steps

__all__ = ["BACKEND_NAME", "ReformableGroup", "register", "release_groups", "cut_groups", "reform_groups",
           "count_collectives", "live_groups", "peek_groups", "degrade_groups"]

BACKEND_NAME = "nbdist"

# The collectives a group forwards (every one that torch's Python API, DDP, FSDP2 and
# torch.distributed.checkpoint call on a group); each call counts towards the group's step.
_COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
                "allgather_into_tensor_coalesced", "alltoall", "alltoall_base", "barrier", "broadcast", "gather",
                "scatter", "reduce", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
                "send", "recv", "recv_anysource", "monitored_barrier", "all_gather_single",
                "all_gather_single_coalesced", "reduce_scatter_single", "reduce_scatter_single_coalesced",
                "all_to_all_single")
_PASSED = ("_start_coalescing", "_end_coalescing", "set_timeout", "_wait_for_pending_works")

_GROUPS: list[weakref.ref] = []  # every group this rank made, in the order it made them


class ReformableGroup(dist.ProcessGroup):
    """A process group whose connections can be dropped and made again while the object lives on.

    Parameters
    ----------
    store : torch.distributed.Store
        The group's own store (torch gives each group a prefixed one).
    rank, size : int
        This rank's place in the group.
    timeout : datetime.timedelta
        The collectives' timeout, as ``init_process_group`` would use it.
    devices : dict
        Device type -> torch backend, e.g. ``{"cpu": "gloo", "cuda": "nccl"}``.
    """

    def __init__(self, store, rank: int, size: int, timeout, devices: dict, name: str = "", desc: str = "",
                 members=()):
        super().__init__(rank, size)
        self._store, self._timeout, self._devices = store, timeout, dict(devices)
        self._name, self._desc = name, desc
        self.members = tuple(members) or tuple(range(size))  # global ranks (torch gives none for the world's)
        self.missing: dict[int, str] = {}  # global rank -> how it died: the group lacks it until the heal
        # A healed rank joins its peers' groups where they re-form them: under the heal's generation.
        self.generation, self.issued, self.group_wide = joining_generation(), 0, 0
        # What messages call it: torch names groups by number; the first one made is the world's.
        self.label = "the default group" if not live_groups() else f"group {name or len(_GROUPS)}"
        self._inner = self._connect()
        _GROUPS.append(weakref.ref(self))

    def _connect(self, deadline: float | None = None):
        """A new inner torch group under this generation's store prefix (blocks until every member
        joins). Re-forming (a healed rank's joins too), the members first wait for each other, and
        gloo then connects them, where a member's death calls either off at once on every member
        (:mod:`nbdist.worker.member_arrival`); every member there by ``deadline`` where given."""
        store = dist.PrefixStore(f"nbdist-gen{self.generation}/", self._store)
        if not self.generation:  # made by its members at once, as torch makes groups
            inner, self._sockets = self._make_inner(store, store, None)
            return inner
        reforming = Reforming(store, self.rank(), self.members, self.generation, self.label)
        with reforming.watched(self._store) as own:
            own = dist.PrefixStore(f"nbdist-gen{self.generation}/", own)
            connect_s = reforming.await_members(own, time.monotonic() + self._timeout.total_seconds()
                                                if deadline is None else deadline)
            inner, self._sockets = self._make_inner(store, own, connect_s, reforming.connect)
            return inner

    def _make_inner(self, store, gloo_store, connect_s: float | None, connect=None):
        """The inner group, and the sockets it opened: gloo's backend connects through ``gloo_store``,
        within ``connect_s``, through ``connect`` where given (:meth:`Reforming.connect`)."""
        before = set(socket_inodes().values())
        inner = _CProcessGroup(store, self.rank(), self.size())
        default, made_by = None, {}
        for device, backend in self._devices.items():
            if backend not in made_by:  # gloo serves CPU and CUDA tensors over one set of connections
                base = gloo_store if backend == "gloo" else store  # NCCL uses its store later, lazily
                made_by[backend] = self._make_backend(backend, dist.PrefixStore(f"{device}/", base), connect_s,
                                                      connect)
            made, kind = made_by[backend]
            inner._register_backend(torch.device(device), kind, made)
            default = kind if default is None or device != "cpu" else default
        inner._set_default_backend(default)
        # gloo connects its full mesh now: the sockets that appeared are this group's, to cut if
        # the rank gets stuck in one of its collectives with no peer free to release it.
        return inner, {fd: inode for fd, inode in socket_inodes().items() if inode not in before}

    def _make_backend(self, backend: str, store, connect_s: float | None, connect=None):
        """One torch backend of the inner group, and its kind: gloo's connects its full mesh now
        (within ``connect_s`` seconds where given, through ``connect``; then the collectives' own
        timeout again)."""
        from torch._C._distributed_c10d import ProcessGroupGloo

        if backend == "gloo":
            opts = ProcessGroupGloo._Options()
            opts._timeout = min(self._timeout, timedelta(seconds=connect_s)) if connect_s else self._timeout
            opts._devices = [ProcessGroupGloo.create_default_device()]
            make = lambda: ProcessGroupGloo(store, self.rank(), self.size(), opts)  # noqa: E731
            made = connect(make, connect_s) if connect is not None else make()
            if opts._timeout != self._timeout:
                made.set_timeout(self._timeout)
            return made, _CProcessGroup.BackendType.GLOO
        from torch._C._distributed_c10d import ProcessGroupNCCL  # only where CUDA is (the worker asks for it then)

        opts = ProcessGroupNCCL.Options()
        opts._timeout = self._timeout
        # As torch's own groups say them: the flight recorder and groupRanks() read these (an NCCL
        # group made after the process's first one would name no ranks).
        opts.global_ranks_in_group, opts.group_name = list(self.members), self._name
        return ProcessGroupNCCL(store, self.rank(), self.size(), opts), _CProcessGroup.BackendType.NCCL

    def release(self) -> None:
        """Drop the connections: a peer waiting in a collective of this group fails at once."""
        inner, self._inner = self._inner, None
        self._sockets = {}
        flight_recorder.abandon(self.label)
        if inner is None:
            return
        if "nccl" in self._devices.values():
            inner.abort()  # NCCL frees kernels that wait on a peer; gloo has nothing to abort
        del inner

    def cut(self) -> int:
        """From another thread, while this rank waits in one of the group's collectives: shut its
        sockets down, so that the wait fails at once, here and at every peer (the object the main
        thread waits on can't be dropped: its frame holds it). NCCL's communicators are aborted.
        Returns how many sockets were cut; the group is re-formed before it is used again."""
        inner, self._inner = self._inner, None
        sockets, self._sockets = self._sockets, {}
        if inner is not None and "nccl" in self._devices.values():
            inner.abort()
        return shut_down_sockets(sockets)

    def reform(self, generation: int, deadline: float | None = None) -> None:
        """Connect again under ``generation`` (every member must call this with the same number),
        every member there by ``deadline`` (``time.monotonic()``) where given."""
        self.release()
        self.generation, self.issued, self.group_wide = generation, 0, 0
        self.missing = {}
        self._inner = self._connect(deadline)

    def lack(self, gone: dict[int, str]) -> None:
        """Members of ``gone`` died: drop the connections, and fail every collective at once, naming
        them, until the heal re-forms the group with their replacements."""
        self.release()
        self.missing = dict(gone)

    def _target(self):
        if self.missing:
            raise RuntimeError(_lacking(self.label, self.missing))
        if self._inner is None:
            raise RuntimeError("nbdist: this process group is being re-formed after an interrupted cell; "
                               "run the cell again")
        return self._inner

    # The C++ side asks the Python object for these (torch's PyProcessGroup trampoline).
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def shutdown(self) -> None:
        if self._inner is not None:
            self._inner.shutdown()

    def abort(self) -> None:
        self.release()

    def _get_sequence_number_for_group(self) -> int:
        return self.issued


def _forward(name: str, counts: bool):
    def method(self, *args, **kwargs):
        target = self._target()
        if not counts:
            return getattr(target, name)(*args, **kwargs)
        point_to_point = name in ("send", "recv", "recv_anysource")
        # Sequence numbers of group-wide collectives only: a send/recv is not every rank's. The
        # number is counted at the stop gate, which raises instead beyond an agreed stop point.
        seq = self.issued + 1 if point_to_point else stop_point.claim(self, name)
        entry = flight_recorder.record(self.label, seq, name, args)
        if not point_to_point:  # a mismatch raises here: every rank that compared used the number up
            flight_recorder.check_collective(self._store, f"nbdist-check/gen{self.generation}/", self.rank(),
                                             self.size(), entry, self._timeout.total_seconds())
        self.issued += 1
        work = getattr(target, name)(*args, **kwargs)
        flight_recorder.watch_work(entry, work)
        return work

    method.__name__ = method.__qualname__ = name
    return method


for _name in _COLLECTIVES:
    setattr(ReformableGroup, _name, _forward(_name, True))
for _name in _PASSED:
    setattr(ReformableGroup, _name, _forward(_name, False))


def _create(options, _backend_options):
    """torch's custom-backend hook: a group's ReformableGroup (torch returns it as the group itself)."""
    return ReformableGroup(options.store, options.group_rank, options.group_size, options.timeout, _DEVICES,
                           name=options.group_id, members=options.global_ranks_in_group)


_DEVICES: dict = {}
_JOINING: list[int] = []  # the generation a healed rank makes its first groups under, until it joined


def joining_generation() -> int:
    """The generation a new group connects under: 0, but in a rank that the heal started, whose
    groups are made while its peers re-form theirs under the heal's generation."""
    if not _JOINING:
        _JOINING.append(int(os.environ.get(HEAL_GENERATION_ENV, "0")))
    return _JOINING[0]


def joined() -> None:
    """A healed rank made every group its peers have: groups made from now on start at 0, as theirs do."""
    _JOINING[:] = [0]


def register(backend: str) -> str:
    """Make ``"nbdist"`` a torch backend that wraps ``backend`` ("gloo" or "nccl"); return its name.

    With NCCL, CPU tensors go through gloo (as ``"cpu:gloo,cuda:nccl"`` would), so object
    collectives and checkpoints of CPU state keep working. With gloo, CUDA tensors go through
    gloo too, as they do in torch's own gloo group: several ranks sharing one GPU can't use NCCL.
    """
    _DEVICES.clear()
    # As torch's own "gloo" does, gloo also takes CUDA tensors (a one-GPU box's ranks share it).
    _DEVICES.update({"cpu": "gloo", "cuda": backend})
    if not hasattr(dist.Backend, BACKEND_NAME.upper()):
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=list(_DEVICES))
    track_ddp_models()
    track_optimizer_steps()
    record_group_calls()  # what a healed rank replays
    _report_wrapped_backend(backend)
    return BACKEND_NAME


def _report_wrapped_backend(backend: str) -> None:
    """``dist.get_backend()`` names the backend the user asked for ("gloo", "nccl"), not "nbdist":
    user code and libraries compare it (``if dist.get_backend() == "nccl"``). Only the public name
    is wrapped: torch's own calls inside ``distributed_c10d`` still see "nbdist", so a
    ``new_group()`` without a backend is re-formable like the default group."""
    public = getattr(dist.get_backend, "_nbdist_public", dist.get_backend)

    def get_backend(group=None):
        name = public(group)
        return dist.Backend(backend) if name == BACKEND_NAME else name

    get_backend.__doc__, get_backend._nbdist_public = public.__doc__, public
    dist.get_backend = get_backend


def live_groups() -> list[ReformableGroup]:
    """This rank's re-formable groups that are still in use, oldest first."""
    groups = [ref() for ref in _GROUPS]
    _GROUPS[:] = [weakref.ref(g) for g in groups if g is not None]
    return [g for g in groups if g is not None]


def peek_groups() -> list[ReformableGroup]:
    """The live groups, for another thread (the signal thread's stop report): reads, never prunes."""
    return [g for g in (ref() for ref in list(_GROUPS)) if g is not None]


def release_groups() -> int:
    """Drop every group's connections (the session does this on the ranks that are free)."""
    groups = live_groups()
    for group in groups:
        group.release()
    return len(groups)


def cut_groups() -> int:
    """Cut every group's connections from a thread of the rank's own (see :meth:`ReformableGroup.cut`)."""
    return sum(group.cut() for group in live_groups())


def reform_groups(generation: int, connect_timeout: float | None = None) -> dict:
    """Connect every group again under ``generation``; the objects (and what holds them) stay.

    Returns what was done, for the cell's note: how many groups, how long each part took, and
    how many DDP models and FSDP2 roots were reset.
    """
    start = time.monotonic()
    deadline = start + connect_timeout if connect_timeout else None  # one for every group
    groups = live_groups()
    for group in groups:
        group.release()
    released = time.monotonic()
    for group in groups:
        group.reform(generation, deadline)
    connected = time.monotonic()
    models = reset_models()
    return {"groups": len(groups), "seconds": time.monotonic() - start, **models,
            "release_s": released - start, "connect_s": connected - released, "reset_s": time.monotonic() - connected}


def degrade_groups(gone: dict[int, str], generation: int, connect_timeout: float | None = None) -> dict:
    """On every survivor after ranks died (``gone``: global rank -> how): each group that held one of
    them lacks it until the heal (its collectives fail at once, naming it); each other group is
    re-formed under ``generation`` among its members, all survivors, so that one left mid-collective
    by the stop that freed them is in step again; within ``connect_timeout`` seconds, as a member
    may die meanwhile (the session then degrades again, without it). Returns ``{"lacking": n,
    "reformed": n}``."""
    lacking = reformed = 0
    deadline = time.monotonic() + connect_timeout if connect_timeout else None
    for group in live_groups():
        dead = {r: why for r, why in gone.items() if r in group.members}
        if dead:
            group.lack(dead)
            lacking += 1
        else:
            group.reform(generation, deadline)
            reformed += 1
    return {"lacking": lacking, "reformed": reformed}


def _lacking(label: str, missing: dict[int, str]) -> str:
    """The one line a collective on a group that lacks a member fails with."""
    one = len(missing) == 1
    who = "; ".join(f"rank {r} {why}" for r, why in sorted(missing.items()))
    ranks = ("rank " if one else "ranks ") + ", ".join(map(str, sorted(missing)))
    them = "it" if one else "them"
    return (f"nbdist: {label} lacks {ranks} ({who}): a collective can't complete without {them}. "
            f"%dist_heal (Session.heal()) brings {them} back from the peers; %dist_restart starts over")


def count_collectives():
    """``{group name: collectives issued}`` of this rank's groups (None without a process group).

    After an interrupted or failed cell, equal counts on every rank mean that no rank left a
    collective its peers did not issue: the groups are still in step.
    """
    if not dist.is_initialized():
        return None
    groups = live_groups()
    if groups:
        return {g.getGroupName(): g.issued for g in groups}
    default = dist.distributed_c10d._get_default_group()
    return {"default": default._get_sequence_number_for_group()}

