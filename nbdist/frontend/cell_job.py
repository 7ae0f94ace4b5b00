"""What a ``%%distributed`` cell becomes before and after its ranks: checked options, ``cell.py``,
the notebook values it reads (a :class:`CellJob`), and how a job starts and finishes.

The world options are flags shared by ``%%distributed`` and ``%dist_start``
(:func:`world_arguments`), checked in one place (:class:`nbdist.options.WorldOptions`).
Everything that can be refused is refused before any process exists, in one line.
"""

from __future__ import annotations

import logging
import os
import types
from dataclasses import dataclass, field

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

from nbdist.errors import LaunchConfigError
from nbdist.frontend.cell_source import CellSource, find_read_names
from nbdist.options import WorldOptions
from nbdist.protocol import rundir
from nbdist.protocol.rundir import PULL_FILE, PUSH_FILE
from nbdist.session.cell_history import KEPT_VALUES_FILE
from nbdist.worker.cell import run_cell

__all__ = ["CellJob", "prepare_cell", "write_cell", "write_cell_record", "start_cell", "finish_cell", "run_attached_cell",
           "keep_notebook_values", "attached_world", "world_arguments", "session_world_arguments", "world_options", "split_names"]

log = logging.getLogger(__name__)

def world_arguments(func):
    """The world options as flags of ``%%distributed``, from their one definition (:class:`WorldOptions`)."""
    for flags, kw in reversed(WorldOptions.magic_flags()):
        func = argument(*flags, **kw)(func)
    return func


def session_world_arguments(func):
    """The same for ``%dist_start``: a session's ranks always join their process group."""
    for flags, kw in reversed(WorldOptions.magic_flags(exclude=("init_process_group",))):
        func = argument(*flags, **kw)(func)
    return func


def world_options(args) -> WorldOptions:
    """The checked WorldOptions of parsed magic flags; a bad one is a one-line UsageError."""
    options = WorldOptions.from_magic_args(args)
    options.env = _parse_env(args.env) or None
    try:
        return options.check()
    except LaunchConfigError as exc:
        raise UsageError(str(exc)) from None


@dataclass
class CellJob:
    """A parsed, checked cell, ready to start: everything is validated before a process exists."""

    args: object
    options: WorldOptions
    engine: object  # the engine launcher (torchrun, mpirun, srun), or None for spawn/attach
    run_id: str
    run_dir: str
    cell_file: str
    pushed: list = field(default_factory=list)  # names of the notebook values in PUSH_FILE
    modules: dict = field(default_factory=dict)  # name -> module name
    pull: list = field(default_factory=list)
    tree: object = None  # the cell's parsed source
    source_text: str = ""  # cell.py's text (a session cell sends it along)
    channel: object = None  # set when each kernel of an attached world spawns its own ranks


def split_names(text: str, option: str) -> list[str]:
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise UsageError(f"{option} takes comma-separated variable names, got {', '.join(map(repr, bad))}")
    return names


def _parse_env(items) -> dict:
    env = {}
    for item in [x for group in (items or []) for x in group]:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--env takes KEY=VALUE pairs, got {item!r}")
        env[key] = value
    return env


def prepare_cell(shell, args, line: str, cell: str) -> CellJob:
    """Check the options, write ``cell.py``, and pick and check what to push.

    Everything that can be refused is refused here, before any process exists; a refused cell
    leaves no run dir behind.
    """
    push = split_names(args.push, "--push")
    pull = split_names(args.pull, "--pull")
    options = world_options(args)
    try:
        engine = options.make_engine()
    except LaunchConfigError as exc:
        raise UsageError(str(exc)) from None
    source = CellSource(line, cell)
    run_id = rundir.new_run_id()
    try:
        run_dir = rundir.create_run_dir(run_id, args.run_dir)
    except LaunchConfigError as exc:  # a runs folder others could write to, say
        raise UsageError(str(exc)) from None
    try:
        return write_cell(shell, args, options, engine, source, run_id, run_dir, push, pull)
    except BaseException:
        rundir.discard_run_dir(run_dir)
        raise


def write_cell(shell, args, options, engine, source, run_id, run_dir, push, pull, on_ranks=frozenset(),
               write_source: bool = True) -> CellJob:
    """Write ``cell.py`` into ``run_dir`` and pickle the notebook values the cell reads.

    ``on_ranks``: names that earlier cells of a session defined on the ranks; the ranks' own
    value wins over a notebook variable of the same name (``--push`` still sends it).
    ``write_source=False``: the caller writes ``cell.py`` (:func:`write_cell_record`) once the cell
    is on its way; a session's ranks get the source with the cell and never read the file.
    """
    cell_file = os.path.join(run_dir, "cell.py")
    if write_source:
        rundir.write_private(cell_file, source.text.encode("utf-8"))
    tree = source.parse(cell_file)  # a SyntaxError names cell.py and the editor's line
    user_ns = shell.user_ns
    hidden = getattr(shell, "user_ns_hidden", {})
    missing = [n for n in push if n not in user_ns]
    if missing:
        raise UsageError(f"--push: no variable named {', '.join(map(repr, missing))} in the notebook")
    job = CellJob(args, options, engine, run_id, run_dir, cell_file, pull=pull)
    # Only names the cell reads travel: an unpicklable, unrelated notebook variable never matters.
    job.tree, job.source_text = tree, source.text
    values = {}
    for name in sorted((find_read_names(tree) - set(on_ranks)) | set(push)):
        if name not in user_ns or (name in hidden and name not in push):
            continue
        value = user_ns[name]
        if isinstance(value, types.ModuleType):
            job.modules[name] = value.__name__  # re-imported by name in the rank
        else:
            values[name] = value
    if values:
        write_pushed(os.path.join(run_dir, PUSH_FILE), values)
        job.pushed = sorted(values)
    return job


def write_cell_record(job: CellJob) -> None:
    """``cell.py``, the record of a cell already sent with its source: a failure to write it (a
    full disk) costs the record, not the cell, which runs meanwhile."""
    try:
        rundir.write_private(job.cell_file, job.source_text.encode("utf-8"))
    except OSError as exc:
        log.warning("nbdist: could not keep the cell's source in %s (%s)", job.cell_file, exc)


KEEP_VALUES_BYTES = 64 << 20  # the notebook values a cell got, kept for %dist_export up to this size


def keep_notebook_values(job) -> str | None:
    """A second name for the file of notebook values the cell is sent (a hard link: no copy), which
    outlives the cell's own (deleted as the cell ends); None when there is none, or it is too big."""
    if not job.pushed:
        return None
    sent, kept = os.path.join(job.run_dir, PUSH_FILE), os.path.join(job.run_dir, KEPT_VALUES_FILE)
    try:
        if os.path.getsize(sent) > KEEP_VALUES_BYTES:
            return None
        os.link(sent, kept)
    except OSError:
        return None
    return kept


def write_pushed(path: str, values: dict) -> None:
    """Write the notebook values a cell reads where its ranks map them (big buffers are not copied
    again); a value that can't travel is a UsageError that names it."""
    from nbdist.protocol.pickling import dump_pickle_checked
    from nbdist.protocol.shared_values import write_value_file

    try:
        write_value_file(path, values, "the notebook variables")
    except TypeError:
        for name, value in values.items():  # which one: the one-line error names it
            try:
                dump_pickle_checked(value, f"notebook variable {name!r}")
            except TypeError as exc:
                raise UsageError(f"{exc} (or name it in neither the cell nor --push)") from None
        raise


def start_cell(shell, job: CellJob):
    """Start the ranks for a prepared cell; ``_dist`` is the Run from now on."""
    from nbdist.run.start import start_run

    rank_args = (job.cell_file, bool(job.pushed), job.modules, job.pull)
    world = attached_world(job)
    if world is not None:  # --nprocs in a kernel that is a rank: each kernel spawns its own ranks
        from nbdist.run.per_kernel import start_per_kernel

        run, job.channel = start_per_kernel(run_cell, rank_args, {}, world, job.options, run_id=job.run_id,
                                            run_dir=job.run_dir)
    else:
        run = start_run(run_cell, rank_args, {}, job.options, launcher=job.engine, run_id=job.run_id,
                        run_dir=job.run_dir)
    shell.user_ns["_dist"] = run
    return run


def finish_cell(shell, job: CellJob, run):
    """Bring back ``--pull`` variables and return rank 0's value (the cell's result)."""
    if job.channel is not None:
        from nbdist.run.per_kernel import gather_per_kernel

        results = gather_per_kernel(run, job.channel)  # every kernel gets every rank's value
    else:
        results = run.wait()
    if job.pull:
        from nbdist.protocol.shared_values import read_value_file

        path = os.path.join(job.run_dir, PULL_FILE)
        try:
            pulled = read_value_file(path)  # big buffers mapped, not copied
        except FileNotFoundError:
            pulled = {"values": {}, "missing": job.pull}
        else:
            os.unlink(path)  # the values are the notebook's now: the run dir keeps its logs only
        shell.user_ns.update(pulled["values"])
        if pulled["missing"]:
            print(f"nbdist: --pull: rank 0 has no variable named {', '.join(pulled['missing'])}")
    first = min(results) if results else None  # rank 0's, or the lowest rank's when --ranks left it out
    return results.get(first) if first is not None else None


def run_attached_cell(shell, job: CellJob):
    """The kernel already is a rank: run the cell here, in the notebook's own namespace."""
    from nbdist.api import launch

    results = launch(run_cell, job.cell_file, {}, {}, [], launcher="attach", backend=job.args.backend,
                     init_process_group=job.args.init_process_group)
    return results.get(0)


def attached_world(job: CellJob):
    """The world this kernel is a rank of (None when it runs alone or spawns regardless)."""
    from nbdist.protocol.world import detect_world

    if job.args.launcher not in ("auto", "attach"):
        return None
    world = detect_world()
    if job.args.launcher == "attach" and world is None:
        raise UsageError("--launcher attach: this kernel is not a rank of a torchrun, MPI or Slurm world")
    return world
