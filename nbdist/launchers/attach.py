"""Attach: this process already is a rank of a torchrun, MPI or Slurm world, so the function runs here.

:func:`run_attached` makes no process. :func:`run_per_kernel` (``nprocs=N`` in such a kernel)
makes each kernel spawn N local ranks of one bigger world instead: global rank = kernel rank
x N + local rank, and the kernels meet at a store that kernel 0 hosts and broadcasts.

In place, the process group comes from the world's own rendezvous (torchrun's env://), under MPI
from a store that rank 0 hosts and broadcasts, and in a plain srun step from a store that task 0
hosts on a port every task derives from the step. Every rank gets back the same
``{rank: value}`` dict, or the same WorkerFailedError.
"""

from __future__ import annotations

import os
import socket

from ..errors import LaunchConfigError, RankFailure, WorkerFailedError
from ..world import WorldInfo

__all__ = ["run_attached", "StoreComm", "start_per_kernel", "gather_per_kernel", "run_per_kernel", "mpi_world",
           "slurm_meeting_point", "first_slurm_host"]

# An attached kernel is a rank for its whole life: the process group (and, under MPI, the store
# that rank 0 hosts) stay up between launches, like a persistent session. Re-creating them on
# the same rendezvous would meet the previous round's keys.
_KEEP = {"rendezvous": None, "gathers": 0, "hosted": None, "slurm_store": None, "agent_store": None}


def mpi_world():
    """``(comm, rank, size, local_rank, local_size)`` from mpi4py, or a clear error without it."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise LaunchConfigError(
            "this kernel runs under MPI, and attaching needs mpi4py: pip install 'nbdist[mpi]' (mpi4py + mpich)"
        ) from None
    comm = MPI.COMM_WORLD
    # local_rank from the ranks that share this node's memory, not from the global rank:
    # on two nodes, global rank 5 is local rank 1.
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return comm, comm.Get_rank(), comm.Get_size(), node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def _node_address(single_node: bool) -> str:
    if single_node:
        return "127.0.0.1"
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    return socket.gethostbyname(socket.gethostname())


def _join_group_mpi(comm, rank, size, single_node, dist_url, backend):
    """Rank 0 hosts the TCPStore on a port it already holds and broadcasts where; all join."""
    import torch.distributed as dist

    from ..rendezvous import open_rendezvous

    rdzv = None
    if dist_url == "auto":
        if rank == 0:
            rdzv = open_rendezvous("auto", size, host=_node_address(single_node))
            where = (rdzv.master_addr, rdzv.master_port)
        else:
            where = None
        addr, port = comm.bcast(where, root=0)
        store = rdzv.store if rdzv is not None else dist.TCPStore(addr, port, size, is_master=False)
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=size)
    else:
        dist.init_process_group(backend=backend, init_method=dist_url, rank=rank, world_size=size)
    return rdzv


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``"gpu[03-05,07],cpu1"`` -> ``"gpu03"``."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist.split("]")[0] + "]"
    if "[" not in head:
        return head
    prefix, ranges = head.rstrip("]").split("[", 1)
    return prefix + ranges.split(",")[0].split("-")[0]


def slurm_meeting_point(env) -> tuple[str, int]:
    """Where the tasks of a Slurm step meet: MASTER_ADDR/PORT if set, else derived from the step.

    The port comes from the job and step ids, so tasks of different steps on one node don't collide.
    """
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return env["MASTER_ADDR"], int(env["MASTER_PORT"])
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
    addr = "127.0.0.1" if nodes == 1 else socket.gethostbyname(first_slurm_host(env["SLURM_STEP_NODELIST"]))
    job, step = int(env.get("SLURM_JOB_ID") or 0), int(env.get("SLURM_STEP_ID") or 0)
    return addr, 20000 + (job * 31 + step) % 20000


def _slurm_store(rank: int, size: int):
    """The step's store, hosted by task 0 at :func:`slurm_meeting_point`, kept for the kernel's life."""
    import datetime

    import torch.distributed as dist

    from ..rendezvous import open_rendezvous

    if _KEEP["slurm_store"] is None:
        addr, port = slurm_meeting_point(os.environ)
        if rank == 0:  # holding the store keeps its server up
            store = open_rendezvous("auto", size, host=addr, port=port).store
        else:
            store = dist.TCPStore(addr, port, size, is_master=False, timeout=datetime.timedelta(minutes=5))
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        _KEEP["slurm_store"] = store
    return _KEEP["slurm_store"]


def _join_group_slurm(rank, size, backend):
    import torch.distributed as dist

    dist.init_process_group(backend=backend, store=_slurm_store(rank, size), rank=rank, world_size=size)


def run_attached(fn, args, kwargs, world: WorldInfo, *, dist_url="auto", backend="auto", init_process_group=True):
    """Run ``fn`` as this rank of ``world``; return every rank's value, gathered, on every rank."""
    import cloudpickle
    import torch.distributed as dist

    from ..worker import bind_device, describe_exception, resolve_backend

    comm = None  # how the kernels gather the values: MPI, else a store that needs no process group
    rank, size = world.rank, world.world_size
    local_rank, local_size = world.local_rank, world.local_world_size
    if world.kind == "mpi":
        comm, rank, size, local_rank, local_size = mpi_world()
    local_rank = local_rank if local_rank is not None else 0
    local_size = local_size if local_size is not None else 1
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_size)
    )
    backend = resolve_backend(backend)
    if init_process_group and not dist.is_initialized():
        bind_device(local_rank, backend)
        if world.kind == "mpi":
            _KEEP["rendezvous"] = _join_group_mpi(comm, rank, size, local_size == size, dist_url, backend)
        elif world.kind == "slurm" and dist_url == "auto":
            # A plain srun step has no channel between its tasks: they meet where rank 0 hosts a
            # store, at an address and port that every task works out alone from the step's env.
            _join_group_slurm(rank, size, backend)
        else:
            init = "env://" if dist_url == "auto" else dist_url
            dist.init_process_group(backend=backend, init_method=init, rank=rank, world_size=size)
    if world.kind == "torchrun":
        comm = _agent_store_comm(rank, size)
    elif world.kind == "slurm" and dist_url == "auto":
        comm = StoreComm(_slurm_store(rank, size), rank, size)
    try:
        value = fn(*args, **kwargs)
        mine = (True, cloudpickle.dumps(value))
    except Exception as exc:
        info = describe_exception(exc)
        mine = (False, info)
    everyone = _gather(mine, comm, rank, size)
    import pickle

    results, failures = {}, {}
    for r, (ok, data) in enumerate(everyone):
        if ok:
            results[r] = pickle.loads(data)
        else:
            failures[r] = RankFailure(
                rank=r, pid=data.get("pid"), exitcode=None, traceback=data["traceback"],
                user_traceback=data.get("user_traceback"), exc_type=data["exc_type"],
                message=data["message"], hint=data.get("hint"), time=data["time"], secondary=data["secondary"],
            )
    if failures:
        raise WorkerFailedError(failures, results)
    return results


class StoreComm:
    """``bcast`` and ``allgather`` between the kernels of a world over a TCPStore: the two calls of
    mpi4py's communicator that nbdist needs, where there is no MPI (torchrun, a plain srun step)."""

    def __init__(self, store, rank: int, size: int):
        self.store, self.rank, self.size = store, rank, size

    def _prefix(self, what: str) -> str:
        _KEEP["gathers"] += 1  # every kernel makes the same calls in the same order: the keys agree
        return f"nbdist/{what}/{_KEEP['gathers']}/"

    def bcast(self, value, root: int = 0):
        import pickle

        key = self._prefix("bcast") + "value"
        if self.rank == root:
            self.store.set(key, pickle.dumps(value))
        self.store.wait([key])
        return pickle.loads(self.store.get(key))

    def allgather(self, value) -> list:
        import pickle

        prefix = self._prefix("gather")
        self.store.set(prefix + str(self.rank), pickle.dumps(value))
        keys = [prefix + str(r) for r in range(self.size)]
        self.store.wait(keys)
        return [pickle.loads(self.store.get(k)) for k in keys]


def _agent_store_comm(rank: int, size: int):
    """torchrun's agent store as a StoreComm (it needs no process group), or None outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not os.environ.get("MASTER_PORT"):
        return None
    import torch.distributed as dist

    if _KEEP["agent_store"] is None:
        _KEEP["agent_store"] = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                             is_master=False)
    return StoreComm(_KEEP["agent_store"], rank, size)


def _gather(mine, comm, rank, size):
    """Every rank's (ok, payload), on every rank: over ``comm`` (MPI or a store), else over torch."""
    if comm is not None:
        return comm.allgather(mine)
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", init_method="env://")
    out = [None] * size
    dist.all_gather_object(out, mine)
    return out


def _kernel_channel(world: WorldInfo):
    """``(comm, rank, size, local_size)`` for talking between the kernels of ``world``."""
    if world.kind == "mpi":
        comm, rank, size, _local, local_size = mpi_world()
        return comm, rank, size, local_size
    if world.kind == "slurm":
        return StoreComm(_slurm_store(world.rank, world.world_size), world.rank, world.world_size), \
            world.rank, world.world_size, world.local_world_size
    comm = _agent_store_comm(world.rank, world.world_size)
    if comm is None:
        raise LaunchConfigError(
            f"nprocs= in a kernel that is a rank of a {world.kind} world needs a channel between the kernels: "
            "start the kernels with mpirun, srun or torchrun"
        )
    return comm, world.rank, world.world_size, world.local_world_size


def start_per_kernel(fn, args, kwargs, world: WorldInfo, options, *, run_id=None, run_dir=None):
    """Start this kernel's ``options.nprocs`` ranks of one world made of every kernel of ``world``.

    Kernel k's ranks are ``k * nprocs + local_rank``. Kernel 0 hosts the store (on loopback when
    every kernel shares its machine) and broadcasts where it is; it keeps the store until
    :func:`gather_per_kernel` has heard from every kernel (so ranks that finish later never lose
    it). Every kernel must call this in the same order (as cells run under ``%px``). Returns
    ``(run, channel)``.
    """
    from ..rendezvous import Rendezvous, open_rendezvous
    from ..start import start_run
    from .spawn import SpawnLauncher

    comm, rank, size, local_size = channel = _kernel_channel(world)
    nprocs = options.nprocs
    rdzv = None
    if options.init_process_group:
        hosted = None
        if rank == 0:
            hosted = open_rendezvous("auto", size * nprocs, host=_node_address(local_size == size))
            _KEEP["hosted"] = hosted.store
        addr, port = comm.bcast((hosted.master_addr, hosted.master_port) if hosted else None, root=0)
        rdzv = Rendezvous("env://", addr, port, True, hosted.store if hosted else None)
    launcher = SpawnLauncher(start_method=options.start_method, nnodes=size, node_rank=rank)
    run = start_run(fn, args, kwargs, options, launcher=launcher, rendezvous=rdzv, run_id=run_id, run_dir=run_dir)
    return run, channel


def gather_per_kernel(run, channel) -> dict:
    """Wait for this kernel's ranks, then every rank's value on every kernel (or one shared error)."""
    comm, rank, size, _ = channel
    stopped = None
    try:
        mine = (True, run.wait(), None)
    except WorkerFailedError as exc:
        mine = (False, exc.results, exc.failures)
    except BaseException as exc:  # stopped (Ctrl-C too) or timed out: the others must not wait for us forever
        stopped, mine = exc, (False, run.results, {})
    everyone = _gather(mine, comm, rank, size)
    _KEEP["hosted"] = None  # every kernel's ranks are done with kernel 0's store now
    if stopped is not None:
        raise stopped
    results, failures = {}, {}
    for _ok, res, fails in everyone:
        results.update(res)
        failures.update(fails or {})
    if failures or not all(ok for ok, _, _ in everyone):
        raise WorkerFailedError(failures, dict(sorted(results.items())), run.run_dir,
                                None if failures else "a kernel of this world stopped its ranks")
    return dict(sorted(results.items()))


def run_per_kernel(fn, args, kwargs, world: WorldInfo, options) -> dict:
    """Every kernel of ``world`` spawns ``options.nprocs`` local ranks; every kernel gets every rank's value."""
    run, channel = start_per_kernel(fn, args, kwargs, world, options)
    return gather_per_kernel(run, channel)
