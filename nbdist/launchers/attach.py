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

import contextlib
import os
import socket
import time

from nbdist.errors import LaunchConfigError, RankFailure, RunStoppedError, WorkerFailedError
from nbdist.launchers.kernel_comm import MpiComm, StopWatch, StoreComm, TorchComm, next_round
from nbdist.protocol.world import WorldInfo
from nbdist.launchers.slurm_hosts import first_slurm_host

__all__ = ["run_attached", "join_world", "run_round", "kernel_comm", "mpi_world", "slurm_meeting_point"]

# An attached kernel is a rank for its whole life: the process group (and, under MPI, the store
# that rank 0 hosts) stay up between launches, like a persistent session. Re-creating them on
# the same rendezvous would meet the previous round's keys.
KEEP = {"rendezvous": None, "hosted": None, "slurm_store": None, "slurm_key": None, "slurm_record": None,
        "agent_store": None, "comm": None}
SLURM_RECORD_WAIT_S = 60.0  # NFS shows task 0's record within its attribute cache time
# A step's tasks start within seconds of each other; a record older than this before this task
# began is an earlier step's (a clock a little apart across nodes is within it).
STALE_RECORD_SLACK_S = 120.0


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
        addr, port = MpiComm(comm).bcast(where, next_round("mpi-store"), root=0)
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
    """The step's store, hosted by task 0 and kept for the kernel's life.

    Where the tasks share a folder (:func:`nbdist.launchers.world_key.shared_dir`: the home folder on
    almost every cluster), task 0 hosts it on a free port and writes where it is, with a fresh key,
    into a 0600 record there: no stranger can predict the port, and the first exchange over it is
    signed (:func:`kernel_comm`). Without one, the port is derived from the job and step ids, as
    before, and nothing is signed (said once). MASTER_ADDR/PORT win when set.
    """
    import datetime

    import torch.distributed as dist

    from nbdist.launchers.rendezvous import open_rendezvous
    from nbdist.launchers.world_key import read_private_record, shared_dir, write_private_record

    if KEEP["slurm_store"] is not None:
        return KEEP["slurm_store"]
    env = os.environ
    addr, port = slurm_meeting_point(env)
    folder, _why = (None, "") if env.get("MASTER_ADDR") and env.get("MASTER_PORT") else shared_dir(env)
    record = f"slurm-{int(env.get('SLURM_JOB_ID') or 0)}.{int(env.get('SLURM_STEP_ID') or 0)}.store"
    if rank == 0:  # holding the store keeps its server up
        hosted = open_rendezvous("auto", size, host=addr, port=0 if folder else port, here=True)
        store = hosted.store
        if folder:
            from nbdist.protocol.signing import new_world_key

            key = new_world_key()
            port = hosted.master_port
            write_private_record(folder, record,
                                 {"addr": addr, "port": port, "key": key.hex(), "written": time.time()})
            KEEP["slurm_key"], KEEP["slurm_record"] = key, os.path.join(folder, record)
    else:
        if folder:
            found = read_private_record(os.path.join(folder, record), SLURM_RECORD_WAIT_S,
                                        fresh=written_since_start)
            if found is None:
                raise LaunchConfigError(
                    f"task {rank} of this Slurm step can't see {os.path.join(folder, record)} (or sees only an "
                    f"earlier step's), where task 0 says where its store is: set NBDIST_SHARED_DIR to a folder "
                    f"every node of the job sees (or MASTER_ADDR/MASTER_PORT)")
            addr, port, KEEP["slurm_key"] = found["addr"], int(found["port"]), bytes.fromhex(found["key"])
        store = dist.TCPStore(addr, port, size, is_master=False, timeout=datetime.timedelta(minutes=5))
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    KEEP["slurm_store"] = store
    return store


def written_since_start(record: dict, slack: float = STALE_RECORD_SLACK_S) -> bool:
    """Whether task 0's record was written for this step, not left by an earlier one with the same
    ids (a step that died before every task joined; Slurm numbers jobs afresh after a reinstall):
    task 0 writes it once it runs, so never long before this task began."""
    import psutil

    return float(record.get("written", 0)) >= psutil.Process().create_time() - slack


def _join_group_slurm(rank, size, backend):
    import torch.distributed as dist

    dist.init_process_group(backend=backend, store=slurm_store(rank, size), rank=rank, world_size=size)
    # Every task connected to the store to join the group, so each has read task 0's record: a later
    # step of a job with the same ids (Slurm numbers jobs afresh after a reinstall) must not find it.
    if rank == 0 and KEEP.get("slurm_record"):
        with contextlib.suppress(OSError):
            os.unlink(KEEP["slurm_record"])
        KEEP["slurm_record"] = None


def run_attached(fn, args, kwargs, world: WorldInfo, *, dist_url="auto", backend="auto", init_process_group=True):
    """Run ``fn`` as this rank of ``world``; return every rank's value, gathered, on every rank."""
    comm, rank, size, _ = join_world(world, dist_url=dist_url, backend=backend, init_process_group=init_process_group)
    comm = kernel_comm(world, rank, size, dist_url, comm)
    return run_round(fn, args, kwargs, comm, rank)


def join_world(world: WorldInfo, *, dist_url="auto", backend="auto", init_process_group=True, reformable=False):
    """Join ``world``'s default process group as its engine placed this process: the rank's env,
    its device bound, the group met at the world's own rendezvous (as a rank nbdist starts would).
    ``reformable``: the groups are nbdist's, as a session's are (an exported job that replays
    stopped cells). Returns ``(mpi comm or None, rank, size, local_rank)``."""
    import torch.distributed as dist

    from nbdist.worker.bootstrap import bind_device, resolve_backend

    comm = None  # mpi4py's world communicator, under MPI
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
        if reformable and backend in ("gloo", "nccl"):
            from nbdist.worker import reformable_groups

            backend = reformable_groups.register(backend)
        if world.kind == "mpi":
            KEEP["rendezvous"] = _join_group_mpi(comm, rank, size, local_size == size, dist_url, backend)
        elif world.kind == "slurm" and dist_url == "auto":
            # A plain srun step has no channel between its tasks: they meet where rank 0 hosts a
            # store, at an address and port that every task works out alone from the step's env.
            _join_group_slurm(rank, size, backend)
        else:
            init = "env://" if dist_url == "auto" else dist_url
            dist.init_process_group(backend=backend, init_method=init, rank=rank, world_size=size)
    return comm, rank, size, local_rank


def kernel_comm(world: WorldInfo, rank: int, size: int, dist_url: str = "auto", mpi=None):
    """How this kernel talks to its peers, signed with the world's key: made once per kernel.

    MPI where the world is MPI's, else a store that needs no process group (torchrun's agent store,
    the Slurm step's), else the world's process group. The key comes from the Slurm record, or is
    agreed (:func:`nbdist.launchers.world_key.agree_world_key`); the first signed exchange checks
    that every kernel holds it, so a stranger's store or a wrong key fails here, in one line.
    """
    if KEEP["comm"] is not None:
        return KEEP["comm"]
    from nbdist.launchers.world_key import agree_world_key

    plain = _transport(world, rank, size, dist_url, mpi)
    key = KEEP["slurm_key"] if isinstance(plain, StoreComm) and plain.store is KEEP["slurm_store"] else None
    if key is None:
        key = agree_world_key(rank, lambda value, what: plain.allgather(value, next_round(what)))
    comm = plain.with_key(key)
    if key is not None:
        comm.allgather("hello", next_round("world-key/check"))  # refused, naming the kernel, without the key
        if rank == 0 and KEEP.get("slurm_record"):
            with contextlib.suppress(OSError):
                os.unlink(KEEP["slurm_record"])  # every task is in: the record's key is no longer read
    KEEP["comm"] = comm
    return comm


def _transport(world: WorldInfo, rank: int, size: int, dist_url: str, mpi):
    if mpi is not None:
        return MpiComm(mpi)
    if world.kind == "torchrun":
        store = agent_store()
        if store is not None:
            return StoreComm(store, rank, size)
    elif world.kind == "slurm" and dist_url == "auto":
        return StoreComm(slurm_store(rank, size), rank, size)
    return TorchComm(rank, size)


def run_round(fn, args, kwargs, comm, rank: int) -> dict:
    """Run ``fn`` here as one round of the world; every kernel gets every value, or the same error.

    Whatever ends this kernel's cell, the round's gather happens: a stop (KeyboardInterrupt) or
    ``sys.exit`` here is posted to the peers (their cells are interrupted and end with "stopped on
    node K"), and re-raised here once every kernel has answered.
    """
    import cloudpickle

    from nbdist.worker.exceptions import describe_exception

    topic = next_round()
    watch = StopWatch(comm, topic)
    ended_here = None
    try:
        try:
            value = fn(*args, **kwargs)
        finally:
            watch.disarm()
        mine = {"ok": True, "value": cloudpickle.dumps(value)}
    except Exception as exc:
        mine = {"ok": False, "error": describe_exception(exc)}
    except BaseException as exc:  # a stop or sys.exit: the round still ends on every kernel
        if watch.by is not None:
            mine = {"ok": False, "stopped_by": watch.by[0]}
        else:
            ended_here = exc
            what = type(exc).__name__
            comm.post_stop(topic, what)
            mine = {"ok": False, "stopped": what}
    everyone = comm.allgather(mine, topic)
    if ended_here is not None:
        raise ended_here
    return _round_outcome(everyone, rank)


def _round_outcome(everyone: list, rank: int) -> dict:
    import pickle

    results, failures = {}, {}
    for r, entry in enumerate(everyone):
        if entry.get("ok"):
            results[r] = pickle.loads(entry["value"])  # checked: it came signed by kernel r
        elif "error" in entry:
            failures[r] = RankFailure.from_record(r, None, entry["error"])
    stopped = {r: e["stopped"] for r, e in enumerate(everyone) if "stopped" in e}
    if stopped:
        node, what = min(stopped.items())
        raise RunStoppedError("stopped", results, report=f"stopped on node {node} ({what} there); "
                              f"this kernel's cell ended with it, and every kernel's round with it")
    if failures:
        raise WorkerFailedError(failures, results)
    return results


def agent_store():
    """torchrun's agent store (it needs no process group), kept for the kernel's life; None outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not os.environ.get("MASTER_PORT"):
        return None
    import torch.distributed as dist

    if KEEP["agent_store"] is None:
        KEEP["agent_store"] = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                             is_master=False)
    return KEEP["agent_store"]
