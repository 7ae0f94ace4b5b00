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

from nbdist.errors import LaunchConfigError, RankFailure, WorkerFailedError
from nbdist.protocol.world import WorldInfo
from nbdist.launchers.slurm_hosts import first_slurm_host

__all__ = ["run_attached", "StoreComm", "mpi_world", "slurm_meeting_point"]

# An attached kernel is a rank for its whole life: the process group (and, under MPI, the store
# that rank 0 hosts) stay up between launches, like a persistent session. Re-creating them on
# the same rendezvous would meet the previous round's keys.
KEEP = {"rendezvous": None, "gathers": 0, "hosted": None, "slurm_store": None, "agent_store": None}


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


def node_address(single_node: bool) -> str:
    if single_node:
        return "127.0.0.1"
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    return socket.gethostbyname(socket.gethostname())


def _join_group_mpi(comm, rank, size, single_node, dist_url, backend):
    """Rank 0 hosts the TCPStore on a port it already holds and broadcasts where; all join."""
    import torch.distributed as dist

    from nbdist.launchers.rendezvous import open_rendezvous

    rdzv = None
    if dist_url == "auto":
        if rank == 0:
            rdzv = open_rendezvous("auto", size, host=node_address(single_node), here=True)
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


def slurm_store(rank: int, size: int):
    """The step's store, hosted by task 0 at :func:`slurm_meeting_point`, kept for the kernel's life."""
    import datetime

    import torch.distributed as dist

    from nbdist.launchers.rendezvous import open_rendezvous

    if KEEP["slurm_store"] is None:
        addr, port = slurm_meeting_point(os.environ)
        if rank == 0:  # holding the store keeps its server up
            store = open_rendezvous("auto", size, host=addr, port=port, here=True).store
        else:
            store = dist.TCPStore(addr, port, size, is_master=False, timeout=datetime.timedelta(minutes=5))
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        KEEP["slurm_store"] = store
    return KEEP["slurm_store"]


def _join_group_slurm(rank, size, backend):
    import torch.distributed as dist

    dist.init_process_group(backend=backend, store=slurm_store(rank, size), rank=rank, world_size=size)


def run_attached(fn, args, kwargs, world: WorldInfo, *, dist_url="auto", backend="auto", init_process_group=True):
    """Run ``fn`` as this rank of ``world``; return every rank's value, gathered, on every rank."""
    import cloudpickle
    import torch.distributed as dist

    from nbdist.worker.bootstrap import bind_device, resolve_backend
    from nbdist.worker.exceptions import describe_exception

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
            KEEP["rendezvous"] = _join_group_mpi(comm, rank, size, local_size == size, dist_url, backend)
        elif world.kind == "slurm" and dist_url == "auto":
            # A plain srun step has no channel between its tasks: they meet where rank 0 hosts a
            # store, at an address and port that every task works out alone from the step's env.
            _join_group_slurm(rank, size, backend)
        else:
            init = "env://" if dist_url == "auto" else dist_url
            dist.init_process_group(backend=backend, init_method=init, rank=rank, world_size=size)
    if world.kind == "torchrun":
        comm = agent_store_comm(rank, size)
    elif world.kind == "slurm" and dist_url == "auto":
        comm = StoreComm(slurm_store(rank, size), rank, size)
    try:
        value = fn(*args, **kwargs)
        mine = (True, cloudpickle.dumps(value))
    except Exception as exc:
        info = describe_exception(exc)
        mine = (False, info)
    everyone = gather(mine, comm, rank, size)
    import pickle

    results, failures = {}, {}
    for r, (ok, data) in enumerate(everyone):
        if ok:
            results[r] = pickle.loads(data)
        else:
            failures[r] = RankFailure.from_record(r, None, data)
    if failures:
        raise WorkerFailedError(failures, results)
    return results


class StoreComm:
    """``bcast`` and ``allgather`` between the kernels of a world over a TCPStore: the two calls of
    mpi4py's communicator that nbdist needs, where there is no MPI (torchrun, a plain srun step)."""

    def __init__(self, store, rank: int, size: int):
        self.store, self.rank, self.size = store, rank, size

    def _prefix(self, what: str) -> str:
        KEEP["gathers"] += 1  # every kernel makes the same calls in the same order: the keys agree
        return f"nbdist/{what}/{KEEP['gathers']}/"

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


def agent_store_comm(rank: int, size: int):
    """torchrun's agent store as a StoreComm (it needs no process group), or None outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not os.environ.get("MASTER_PORT"):
        return None
    import torch.distributed as dist

    if KEEP["agent_store"] is None:
        KEEP["agent_store"] = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                             is_master=False)
    return StoreComm(KEEP["agent_store"], rank, size)


def gather(mine, comm, rank, size):
    """Every rank's (ok, payload), on every rank: over ``comm`` (MPI or a store), else over torch."""
    if comm is not None:
        return comm.allgather(mine)
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", init_method="env://")
    out = [None] * size
    dist.all_gather_object(out, mine)
    return out


