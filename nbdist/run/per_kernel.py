"""``nprocs=N`` in a kernel that already is a rank of a torchrun, MPI or Slurm world: every kernel
spawns N ranks of one bigger world (global rank = kernel rank x N + local rank), kernel 0 hosts the
store and broadcasts where it is, and every kernel gets every rank's value.
"""

from __future__ import annotations

from nbdist.errors import LaunchConfigError, WorkerFailedError
from nbdist.launchers.attach import KEEP, kernel_comm, mpi_world, node_address
from nbdist.launchers.kernel_comm import TorchComm, next_round
from nbdist.protocol.world import WorldInfo

__all__ = ["start_per_kernel", "gather_per_kernel", "run_per_kernel"]


def _kernel_channel(world: WorldInfo):
    """``(comm, rank, size, local_size)`` for talking between the kernels of ``world``."""
    if world.kind == "mpi":
        mpi, rank, size, _local, local_size = mpi_world()
        return kernel_comm(world, rank, size, mpi=mpi), rank, size, local_size
    comm = kernel_comm(world, world.rank, world.world_size)
    if isinstance(comm, TorchComm):  # the kernels have no process group of their own here
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
    from nbdist.launchers.rendezvous import Rendezvous, open_rendezvous
    from nbdist.launchers.spawn import SpawnLauncher
    from nbdist.run.start import start_run

    comm, rank, size, local_size = channel = _kernel_channel(world)
    nprocs = options.nprocs
    rdzv = None
    if options.init_process_group:
        hosted = None
        if rank == 0:
            hosted = open_rendezvous("auto", size * nprocs, host=node_address(local_size == size), here=True)
            KEEP["hosted"] = hosted.store
        addr, port = comm.bcast((hosted.master_addr, hosted.master_port) if hosted else None,
                                next_round("per-kernel-store"), root=0)
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
    everyone = comm.allgather(mine, next_round("per-kernel"))
    KEEP["hosted"] = None  # every kernel's ranks are done with kernel 0's store now
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
