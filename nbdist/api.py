"""The plain API: ``launch`` a function on N ranks, ``ps`` and ``kill`` what runs are left."""

from __future__ import annotations

import numbers
import signal

from . import proctree
from .errors import LaunchConfigError
from .launchers import check_launcher_name, make_engine_launcher
from .rendezvous import check_dist_url
from .world import detect_world

__all__ = ["launch", "ps", "kill", "default_nprocs"]

BACKENDS = ("auto", "gloo", "nccl", "mpi", "ucc", "xccl")


def default_nprocs() -> int:
    """The number of GPUs, or 2 on a machine without one. Never initialises CUDA (fork stays safe)."""
    try:
        import torch

        n = torch.cuda.device_count()  # NVML-based where possible: no CUDA context is created
    except Exception:
        n = 0
    return n if n > 0 else 2


def _check_inputs(fn, nprocs, launcher, dist_url, backend, timeout, env):
    if not callable(fn):
        raise LaunchConfigError(f"fn must be callable, got {type(fn).__name__}")
    if nprocs is not None and (isinstance(nprocs, bool) or not isinstance(nprocs, numbers.Integral) or nprocs < 1):
        raise LaunchConfigError(f"nprocs must be an int >= 1, got {nprocs!r}")
    check_launcher_name(launcher)
    check_dist_url(dist_url)
    if backend not in BACKENDS:
        raise LaunchConfigError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout <= 0):
        raise LaunchConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if env is not None and (
        not isinstance(env, dict) or not all(isinstance(k, str) and k and "=" not in k for k in env)
    ):
        raise LaunchConfigError("env must be a dict of variable names to values, e.g. {'NCCL_DEBUG': 'INFO'}")


def launch(fn, *args, nprocs=None, launcher="auto", dist_url="auto", backend="auto", init_process_group=True,
           timeout=None, env=None, join=True, start_method="spawn", run_dir=None, stop_timeout=5.0,
           launcher_args=None, master_addr="127.0.0.1", **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` PyTorch ranks and return every rank's value.

    Parameters
    ----------
    fn : callable
        Runs on every rank. Lambdas, closures and functions or classes defined in the notebook
        work: they are cloudpickled by value into the run dir.
    nprocs : int, optional
        Number of ranks. Default: the attached world's size when attaching, else the number of
        GPUs (2 on a machine without one).
    launcher : {"auto", "spawn", "attach", "mpirun"}
        "auto" attaches when this process already is a rank of a torchrun or MPI world of more
        than one rank, and spawns otherwise. "mpirun" starts the ranks with
        ``mpiexec -n N [launcher_args] python -m nbdist.worker RUN_DIR``.
    dist_url : str
        "auto" (a loopback port that the kernel holds for the run), "env://" or "tcp://HOST:PORT".
    backend : str
        "auto" is nccl where CUDA is available and gloo otherwise.
    init_process_group : bool
        Initialise the default process group before ``fn`` runs.
    timeout : float, optional
        Seconds; on expiry every rank's stack is dumped into its log and the run is stopped.
    env : dict, optional
        Extra environment for the ranks (set before torch is imported there).
    join : bool
        True: wait and return ``{rank: value}``. False: return the :class:`nbdist.Run` at once.
    start_method : {"spawn", "fork"}
        How torch starts the ranks. "fork" is refused once CUDA is initialised here.
    run_dir : str, optional
        Folder under which the run dir is made (default ``$NBDIST_RUN_DIR`` or a private temp folder).
    launcher_args : list of str, optional
        Extra arguments for the engine (``["--hostfile", "hosts"]`` for mpirun).
    master_addr : str
        Where the kernel's rendezvous store listens: 127.0.0.1 unless ranks run on other machines.

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
    from .run import start_run

    _check_inputs(fn, nprocs, launcher, dist_url, backend, timeout, env)
    world = detect_world() if launcher in ("auto", "attach") else None
    if launcher_args is not None and launcher in ("auto", "spawn", "attach"):
        raise LaunchConfigError(f"launcher_args are for an engine (launcher='mpirun'), not launcher={launcher!r}")
    if launcher == "attach" and world is None:
        raise LaunchConfigError("launcher='attach' needs a torchrun, MPI or Slurm world of more than one rank around this process")
    if world is not None:
        from .launchers.attach import run_attached

        if nprocs is not None and nprocs != world.world_size:
            raise LaunchConfigError(
                f"this process is rank {world.rank} of a {world.kind} world of {world.world_size}; "
                f"nprocs={nprocs} doesn't match (leave it out, or use launcher='spawn')"
            )
        return run_attached(fn, args, kwargs, world, dist_url=dist_url, backend=backend,
                            init_process_group=init_process_group)
    engine = make_engine_launcher(launcher, launcher_args)
    run = start_run(
        fn, args, kwargs, nprocs=nprocs or default_nprocs(), runs_root=run_dir, backend=backend, dist_url=dist_url,
        init_process_group=init_process_group, timeout=timeout, env=env, start_method=start_method,
        stop_timeout=stop_timeout, launcher=engine, master_addr=master_addr,
    )
    if not join:
        return run
    return run.wait()


def ps(run_id: str | None = None) -> list[proctree.MarkedProcess]:
    """Live processes of this user that carry a run's marker: leftovers of this or any kernel.

    Examples
    --------
    >>> for p in nbdist.ps():
    ...     print(p.run_id, p.rank, p.pid)
    """
    return proctree.find_marked(run_id)


def kill(run_id: str | None = None, timeout: float = 3.0) -> int:
    """Stop the processes of one run (or of every run) and return how many were stopped.

    Only processes of this user that carry the marker are touched; never anything by name.

    Examples
    --------
    >>> nbdist.kill()          # every leftover of every run
    3
    """
    from .run import _LIVE_RUNS

    found = proctree.find_marked(run_id)
    stopped = 0
    for run in list(_LIVE_RUNS):  # runs of this kernel: stop them through their Run, which reaps
        if run_id in (None, run.run_id) and not run.done:
            mine = [p for p in found if p.run_id == run.run_id]
            report = run.kill()
            stopped += len(mine) - len(report.survivors) if report else len(mine)
    left = [p for p in proctree.find_marked(run_id)]
    for rid in sorted({p.run_id for p in left}):
        procs = [p for p in left if p.run_id == rid]
        leaders = [p.pid for p in procs if p.rank is not None]
        report = proctree.stop_tree(leaders, rid, (signal.SIGTERM, signal.SIGKILL), timeout=timeout)
        stopped += len(procs) - len(report.survivors)
    return stopped
