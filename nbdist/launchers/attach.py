"""Attach: this process already is a rank of a torchrun, MPI or Slurm world, so the function runs here.

No process is made. The process group comes from the world's own rendezvous (torchrun's
env://), or, under MPI, from a store that rank 0 hosts and whose address it broadcasts. Every
rank gets back the same ``{rank: value}`` dict, or the same WorkerFailedError.
"""

from __future__ import annotations

import os
import socket

from ..errors import LaunchConfigError, RankFailure, WorkerFailedError
from ..world import WorldInfo

__all__ = ["run_attached", "mpi_world"]

# An attached kernel is a rank for its whole life: the process group (and, under MPI, the store
# that rank 0 hosts) stay up between launches, like a persistent session. Re-creating them on
# the same rendezvous would meet the previous round's keys.
_KEEP = {"rendezvous": None, "gathers": 0}


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


def run_attached(fn, args, kwargs, world: WorldInfo, *, dist_url="auto", backend="auto", init_process_group=True):
    """Run ``fn`` as this rank of ``world``; return every rank's value, gathered, on every rank."""
    import cloudpickle
    import torch.distributed as dist

    from ..worker import bind_device, describe_exception, resolve_backend

    comm = None
    rank, size = world.rank, world.world_size
    local_rank, local_size = world.local_rank, world.local_world_size
    if world.kind == "mpi":
        comm, rank, size, local_rank, local_size = mpi_world()
    elif world.kind == "slurm" and dist_url == "auto" and init_process_group:
        raise LaunchConfigError(
            "attaching to a Slurm step needs a rendezvous: run the kernel with 'srun --mpi=pmi2' and mpi4py, "
            "or pass dist_url='tcp://HOST:PORT' (or 'env://' with MASTER_ADDR/MASTER_PORT)"
        )
    local_rank = local_rank if local_rank is not None else 0
    local_size = local_size if local_size is not None else 1
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_size)
    )
    backend = resolve_backend(backend)
    if init_process_group and not dist.is_initialized():
        bind_device(local_rank, backend)
        if comm is not None:
            _KEEP["rendezvous"] = _join_group_mpi(comm, rank, size, local_size == size, dist_url, backend)
        else:
            init = "env://" if dist_url == "auto" else dist_url
            dist.init_process_group(backend=backend, init_method=init, rank=rank, world_size=size)
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


def _gather(mine, comm, rank, size):
    """Every rank's (ok, payload), on every rank.

    Over MPI when there is MPI; under torchrun over the agent's own store, which needs no
    process group (the function may have destroyed it, or never made one); else over torch.
    """
    if comm is not None:
        return comm.allgather(mine)
    import pickle

    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("MASTER_PORT"):
        _KEEP["gathers"] += 1  # every rank calls launch in the same order, so the counters agree
        prefix = f"nbdist/gather/{_KEEP['gathers']}/"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        store.set(prefix + str(rank), pickle.dumps(mine))
        keys = [prefix + str(r) for r in range(size)]
        store.wait(keys)
        return [pickle.loads(store.get(k)) for k in keys]
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", init_method="env://")
    out = [None] * size
    dist.all_gather_object(out, mine)
    return out
