"""The world of an exported job (``%dist_export``): what its script's first line, ``nbdist.join_job``, does.

A job script runs the same three ways:

- ``python job.py``: no engine around it. The script starts ``nprocs`` local ranks through
  :func:`nbdist.launch`, each running the script itself, shows their lines as they come,
  rank-prefixed (the text view), and exits with their status (0, or 1 naming the rank that failed
  first). The script's own process runs none of its cells.
- under torchrun, srun or mpirun: the engine placed this process; it joins the world's process
  group the way an attached kernel does (:func:`nbdist.launchers.attach.join_world`: the same
  backend choice and device binding as the ranks nbdist starts), and the cells run here.
- in a rank that ``python job.py`` started: the worker made the group already; the cells run.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import sys
import traceback
from dataclasses import dataclass

__all__ = ["join_job", "JobWorld", "JOB_ENV"]

JOB_ENV = "NBDIST_JOB_SCRIPT"  # set in the ranks that ``python job.py`` starts: the script they run


@dataclass
class JobWorld:
    """This process's place in the job, and the files that came beside the script.

    Attributes
    ----------
    rank, world_size, local_rank : int
        As torch defines them.
    files : str
        The folder beside the script that holds what could not be written as code (notebook
        values, pickled as the session's cells got them).
    """

    rank: int
    world_size: int
    local_rank: int
    files: str

    def load(self, name: str, names: list[str]) -> dict:
        """``names`` from the value file ``name`` beside the script (as a cell of the session got them)."""
        from nbdist.protocol.shared_values import read_value_file

        values = read_value_file(os.path.join(self.files, name))
        return {n: values[n] for n in names}

    def call(self, name: str):
        """Run the function call pickled in ``name`` beside the script (a ``Session.run`` cell)."""
        with open(os.path.join(self.files, name), "rb") as fh:
            fn, args, kwargs = pickle.load(fh)
        return fn(*args, **kwargs)

    @contextlib.contextmanager
    def replay(self, reached: dict, failed: bool = False, reset_models: bool = False):
        """Run the ``with`` block (a cell that was stopped or failed in the session) to where it
        ended there: each rank raises before the first collective beyond ``reached[rank]``
        (``{group name: collectives}``, :mod:`nbdist.worker.cell_reach`), and the job goes on.
        ``failed``: an exception the cell raises (the session's failure, raised again) is printed
        and the job goes on too; ``reset_models``: each DDP/FSDP2 model's half-done step is reset
        after it, as the session did."""
        from nbdist.worker import cell_reach, stop_point

        start = cell_reach.group_counts()  # nbdist's groups (join_job(..., replay=True)), else none
        mine = reached.get(self.rank)
        if mine and not set(mine) & set(start):  # nothing would stop it: a stopped loop would run for ever
            raise RuntimeError(f"this job can't replay the cell as it ran: the session's rank {self.rank} counted "
                               f"collectives on groups {sorted(mine)}, and the job has {sorted(start) or 'none'} "
                               f"of nbdist's (nbdist.join_job(..., replay=True) makes them)")
        stop_point.begin_cell()
        if mine is not None:
            stop_point.arm({g: start.get(g, 0) + n for g, n in mine.items()})
        try:
            yield
        except BaseException as exc:
            hit = stop_point.take_hit()
            if hit is not None:
                print(f"nbdist: rank {self.rank} stopped before {hit}, as it did in the session", file=sys.stderr)
            elif failed and isinstance(exc, (Exception, SystemExit)):  # the session caught both
                tb = exc.__traceback__
                while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
                    tb = tb.tb_next  # from the cell's own line: this context manager is nbdist's
                traceback.print_exception(type(exc), exc, tb)
                print(f"nbdist: rank {self.rank} failed here in the session too; the job goes on, as the session did",
                      file=sys.stderr)
            else:
                raise
        finally:
            stop_point.end_cell()
            if reset_models:
                from nbdist.worker.model_reset import reset_models as reset

                reset()

    @staticmethod
    def rebuild_ddp_models() -> int:
        """Where the session healed a rank: every DDP model's reducer built afresh, as the heal
        rebuilt them (:func:`nbdist.worker.namespace_copy.rebuild_ddp_reducers`), so the next step
        issues the same collectives (its bucket rebuild) as the session's did."""
        from nbdist.worker.namespace_copy import rebuild_ddp_reducers

        return rebuild_ddp_reducers()

    @staticmethod
    def sync_replicas(src: int) -> dict:
        """Where the session re-synced its replicas (``%dist_sync``): every DDP model and its
        optimizers set from rank ``src``'s, as there (:func:`nbdist.worker.replica_sync.sync_replicas`)."""
        from nbdist.worker.replica_sync import sync_replicas

        return sync_replicas(src)

    @staticmethod
    def keep(namespace: dict, names: list[str]) -> dict:
        """The ranks' own values of ``names``, to put back after a notebook cell that defines them too."""
        return {n: namespace[n] for n in names if n in namespace}


def join_job(script: str, nprocs: int = 2, backend: str = "auto", env: dict | None = None,
             timeout: float | None = None, replay: bool = False) -> JobWorld:
    """Join the world of an exported job, or start it (see the module).

    Parameters
    ----------
    script : str
        The job script's ``__file__``; its files are in ``<script stem>_files`` beside it.
    nprocs : int
        Ranks to start under ``python job.py`` (the session's world size, or ``%dist_export --nprocs``).
    backend : str
        As for :func:`nbdist.launch`: "auto" is nccl with CUDA, gloo without.
    env : dict, optional
        The session's ``--env``: set in each rank before torch is imported there.
    timeout : float, optional
        Under ``python job.py``: seconds, then every rank's stack is dumped and the job stopped.
    replay : bool
        The job replays stopped or failed cells (``%dist_export --as-ran``): its process groups are
        nbdist's, as a session's are, whose stop gate :meth:`JobWorld.replay` arms.

    Returns
    -------
    JobWorld
        In a rank (under an engine, or one that ``python job.py`` started). Under ``python job.py``
        itself it does not return: it exits with the ranks' status.

    Examples
    --------
    The first lines of a script that ``%dist_export job.py`` wrote::

        import nbdist
        _job = nbdist.join_job(__file__, nprocs=2, backend="auto")
        if _job.rank in (1,):
            print("only on rank 1")
    """
    script = os.path.abspath(script)
    files = os.path.join(os.path.dirname(script), os.path.splitext(os.path.basename(script))[0] + "_files")
    for key, value in (env or {}).items():
        os.environ.setdefault(key, str(value))  # before the cells import torch; the engine's own wins
    if os.environ.get(JOB_ENV) == script:  # a rank that `python job.py` started: the group is up
        _track_models()
        return JobWorld(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                        int(os.environ.get("LOCAL_RANK", "0")), files)
    from nbdist.protocol.world import detect_world

    world = detect_world()
    if world is None:
        sys.exit(_run_locally(script, nprocs, backend, env, timeout, replay))
    import torch.distributed as dist

    from nbdist.launchers.attach import join_world

    _, rank, size, local_rank = join_world(world, backend=backend, reformable=replay)
    _track_models()
    atexit.register(_leave_group, dist)
    _write_whole_lines()
    return JobWorld(rank, size, local_rank, files)


def _track_models() -> None:
    """Know the DDP models the cells build, as a session's ranks do: a heal's reducer rebuild and a
    re-sync act on them (a replay's groups track them already; doing it twice is a no-op)."""
    from nbdist.worker.model_reset import track_ddp_models

    track_ddp_models()


def _write_whole_lines() -> None:
    """Each line out in one write, as it ends: an engine that prefixes ranks' lines (mpirun
    -prepend-rank, srun --label, torchrun --tee) then never splits one, and lines come as they are made."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=False)
        except (AttributeError, ValueError):  # not a TextIOWrapper (redirected by the user)
            pass


def _leave_group(dist) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def run_job_script(script: str) -> None:
    """On each rank that ``python job.py`` started: run the script in this rank's ``__main__``
    (classes it defines pickle by reference, as a notebook cell's do on a session's ranks)."""
    main = sys.modules["__main__"].__dict__
    main["__file__"] = script
    with open(script, encoding="utf-8") as fh:
        code = compile(fh.read(), script, "exec")
    exec(code, main)


def _run_locally(script: str, nprocs: int, backend: str, env: dict | None, timeout: float | None,
                 replay: bool = False) -> int:
    """``python job.py``: the ranks, their lines as they come, and the exit status."""
    from nbdist.errors import WorkerFailedError
    from nbdist.frontend.views.text import TextView
    from nbdist.options import WorldOptions
    from nbdist.run.start import start_run

    rank_env = {**(env or {}), JOB_ENV: script}
    options = WorldOptions.from_call({"nprocs": nprocs, "backend": backend, "env": rank_env, "timeout": timeout}).check()
    # nbdist.launch's own path, with a session's groups where the job replays stopped cells.
    run = start_run(run_job_script, (script,), {}, options, launcher=options.make_engine(), reformable=replay)
    view = TextView(run)
    view._in_cell = False  # no notebook cell: rank 0's displays are printed as lines too
    try:
        while not run.done:
            view.flush()
            run._done.wait(0.1)
    except KeyboardInterrupt:
        run.interrupt()
        view.flush(final=True)
        return 130
    view.flush(final=True)
    try:
        run.wait()
    except WorkerFailedError as exc:
        print(f"nbdist: the job failed: {exc}", file=sys.stderr)
        return 1
    return 0
