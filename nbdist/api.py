"""The plain API: ``launch`` a function on N ranks, ``ps`` and ``kill`` what runs are left."""

from __future__ import annotations

import signal

from nbdist.errors import LaunchConfigError
from nbdist.launchers.cuda_watch import watch_cuda_init
from nbdist.options import BACKENDS, WorldOptions, default_nprocs
from nbdist.protocol.world import detect_world
from nbdist.run import teardown
from nbdist.run.processes import MarkedProcess, find_marked

__all__ = ["launch", "ps", "kill", "default_nprocs", "BACKENDS"]

def launch(fn, *args, nprocs=None, launcher="auto", dist_url="auto", backend="auto", init_process_group=True,
           timeout=None, env=None, join=True, start_method=None, run_dir=None, stop_timeout=5.0,
           launcher_args=None, nnodes=1, node_rank=0, master_addr=None, master_port=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` PyTorch ranks and return every rank's value.

    Parameters
    ----------
    fn : callable
        Runs on every rank. Lambdas, closures and functions or classes defined in the notebook
        work: they are cloudpickled by value into the run dir.
    *args, **kwargs
        Passed to ``fn`` on every rank (pickled once, before any process starts).
    nprocs : int, optional
        Number of ranks (of this node, for torchrun; of the step, for srun). Default: the number
        of GPUs (2 on a machine without one). In a kernel that already is a rank of a world
        (launcher "auto"/"attach"): leave it out to run ``fn`` in this process as that rank, or
        give N to have every kernel of the world spawn N ranks, global rank = kernel rank x N
        + local rank.
    launcher : {"auto", "spawn", "attach", "torchrun", "mpirun", "srun"}
        "auto" attaches when this process already is a rank of a torchrun, MPI or Slurm world of
        more than one rank, and spawns otherwise. The engines run
        ``python -m nbdist.worker RUN_DIR`` on every rank: "torchrun" as
        ``torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint
        MASTER_ADDR:MASTER_PORT``, "mpirun" as ``mpiexec -n N [launcher_args]``, "srun" as
        ``srun -n N [-N nnodes] [launcher_args]``.
    dist_url : str
        "auto" (a loopback port that the kernel holds for the run), "env://" or "tcp://HOST:PORT".
    backend : str
        "auto" is nccl where CUDA is available and gloo otherwise; gloo also where more
        ranks that nbdist starts on one machine would share its GPUs than it has (NCCL wants a
        GPU per rank; gloo takes their CUDA tensors).
    init_process_group : bool
        Initialise the default process group before ``fn`` runs.
    timeout : float, optional
        Seconds; on expiry every rank's stack is dumped into its log and the run is stopped.
    env : dict, optional
        Extra environment for the ranks (set before torch is imported there).
    join : bool
        True: wait and return ``{rank: value}``. False: return the :class:`nbdist.Run` at once.
    start_method : {None, "warm", "spawn", "fork"}
        How this kernel makes its ranks. "warm": forked from the warm template, a clean process
        that imported torch already (:func:`nbdist.warm`; ready in milliseconds, safe after CUDA);
        "spawn": a fresh interpreter per rank; "fork": a fork of this process, refused once CUDA
        is initialised here. None: ``$NBDIST_START_METHOD``, else "warm" when the template is
        ready and "spawn" otherwise (never a wait for the template).
    run_dir : str, optional
        Folder under which the run dir is made (default ``$NBDIST_RUN_DIR`` or a private temp folder).
    stop_timeout : float
        Seconds a stop (an interrupt, a failing rank, leaving the ``with`` block) gives the ranks
        from SIGINT through SIGTERM to SIGKILL: one deadline for the whole ladder.
    launcher_args : list of str, optional
        Extra arguments for the engine (``["--hostfile", "hosts"]`` for mpirun).
    nnodes, node_rank : int
        torchrun: how many nodes (kernels, or ``torchrun`` started by hand) make the world, and
        which one this is; this node's ranks are ``node_rank * nprocs + local_rank``. srun: the
        number of nodes (``-N``) the ``nprocs`` tasks spread over.
    master_addr : str, optional
        Where the ranks reach the kernel (its store and output channel) for spawn, mpirun and
        srun: 127.0.0.1, or this machine's address when the engine may place ranks on other
        machines (a hostfile, ``nnodes > 1``, a multi-node allocation). For torchrun with
        ``nnodes > 1``: node 0's address, where the c10d rendezvous is (default 127.0.0.1).
    master_port : int, optional
        torchrun with ``nnodes > 1``: the rendezvous port, the same on every node.

    Returns
    -------
    dict or Run
        ``{rank: value}`` for every rank, or the running :class:`nbdist.Run` when ``join=False``.

    Raises
    ------
    WorkerFailedError
        A rank failed; ``.rank`` is the first to fail, ``.results`` holds the ranks that finished.
    LaunchConfigError
        Bad input, before any process starts.

    Examples
    --------
    >>> import nbdist, torch, torch.distributed as dist
    >>> def total(x):
    ...     t = torch.tensor([x * (dist.get_rank() + 1)])
    ...     dist.all_reduce(t)
    ...     return t.item()
    >>> nbdist.launch(total, 1.0, nprocs=4)
    {0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0}
    """
    from nbdist.run.start import start_run

    if not callable(fn):
        raise LaunchConfigError(f"fn must be callable, got {type(fn).__name__}")
    options = WorldOptions.from_call(locals()).check()
    watch_cuda_init()  # from now on, a fork refusal can say where CUDA was first initialised
    world = detect_world() if launcher in ("auto", "attach") else None
    if launcher == "attach" and world is None:
        raise LaunchConfigError("launcher='attach' needs a torchrun, MPI or Slurm world of more than one rank around this process")
    if world is not None and nprocs is not None:
        from nbdist.run.per_kernel import run_per_kernel

        # Each kernel of the world spawns nprocs ranks of its own: one world of world_size * nprocs.
        return run_per_kernel(fn, args, kwargs, world, options)
    if world is not None:
        from nbdist.launchers.attach import run_attached

        return run_attached(fn, args, kwargs, world, dist_url=dist_url, backend=backend,
                            init_process_group=init_process_group)
    run = start_run(fn, args, kwargs, options, launcher=options.make_engine())
    if not join:
        return run
    return run.wait()


def ps(run_id: str | None = None) -> list[MarkedProcess]:
    """Live processes of this user that carry a run's marker: leftovers of this or any kernel.

    Each one says whose it is (``p.whose()``: this kernel, another live kernel, or orphaned).

    Examples
    --------
    >>> for p in nbdist.ps():
    ...     print(p.run_id, p.rank, p.pid)
    """
    return find_marked(run_id)


def kill(run_id: str | None = None, timeout: float = 3.0, all: bool = False) -> int:  # noqa: A002
    """Stop leftover processes and return how many were stopped.

    By default: this kernel's runs and sessions, and orphans (processes whose kernel is gone);
    another live kernel's runs only by their ``run_id`` or with ``all=True``. A live kernel's warm
    template is not a run: only its run id ends it (``%dist_warm --off`` retires this kernel's).
    Only processes of this user that carry the marker are touched; never anything by name.

    Examples
    --------
    >>> nbdist.kill()                  # this kernel's runs and every orphan
    3
    >>> nbdist.kill("20991231-120000-abcdef")   # one run, whoever's it is
    """
    from nbdist.run.state import live_runs

    def in_scope(p) -> bool:
        if run_id is not None or p.orphaned:
            return True
        return not p.is_template and (all or p.mine)

    found = [p for p in find_marked(run_id) if in_scope(p)]
    stopped = 0
    for run in live_runs():  # runs of this kernel: stop them through their Run, which reaps
        if run_id in (None, run.run_id):
            mine = [p for p in found if p.run_id == run.run_id]
            report = run.kill()
            stopped += len(mine) - len(report.survivors) if report else len(mine)
    left = [p for p in find_marked(run_id) if in_scope(p)]
    for rid in sorted({p.run_id for p in left}):
        procs = [p for p in left if p.run_id == rid]
        leaders = [p.pid for p in procs if p.rank is not None]
        report = teardown.stop_tree(leaders, rid, (signal.SIGTERM, signal.SIGKILL), timeout=timeout)
        stopped += len(procs) - len(report.survivors)
    return stopped
