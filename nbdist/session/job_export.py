"""A session, exported as a job: which of its cells go in, which are left out and why.

:func:`plan_job` reads an incarnation's history (:mod:`nbdist.session.cell_history`) into a
:class:`JobPlan`: the cells that finished, in the order they ran, each guarded by the ranks it ran
on, with the notebook values it read (the very values it got, from its cell dir); and a line for
each cell left out (failed, stopped, still running, using the kernel's ``_dist`` or a debugger,
values pushed from code). The front end adds the notebook's own definitions
(:mod:`nbdist.frontend.export_notebook`); :func:`write_job` writes the script, its files and a
Slurm batch file (:mod:`nbdist.session.job_script`).
"""

from __future__ import annotations

import ast
import os
import platform
import shutil
from dataclasses import dataclass, field

from nbdist.session.cell_history import CellRecord

__all__ = ["JobStep", "JobPlan", "plan_job", "plan_one_shot_job", "write_job", "unexportable_reason"]

# What only the kernel has: a cell that reads one of these can't run in a job.
_KERNEL_ONLY = {"_dist": "it reads _dist (the kernel's handle on a run)",
                "get_ipython": "it calls get_ipython() (there is no IPython in a job)",
                "breakpoint": "it calls the debugger (breakpoint())"}


@dataclass
class JobStep:
    """One piece of the job's script, in the order the session ran it."""

    label: str  # the comment above it
    code: str = ""  # Python
    ranks: list[int] | None = None  # a guard: only these ranks run it (None: every rank)
    modules: dict[str, str] = field(default_factory=dict)  # names bound to modules before it
    values_from: str | None = None  # a value file to copy beside the script
    value_names: list[str] = field(default_factory=list)  # names set from it before the code
    call: tuple | None = None  # a function call (fn, args, kwargs), pickled beside the script
    keep: list[str] = field(default_factory=list)  # the ranks' own names a notebook cell must not replace
    notebook: bool = False  # a notebook cell (the kernel's own code), not a session cell
    # A stopped or failed cell replayed to where it ended (--as-ran): {rank: {group: collectives}};
    # ``failed``: its failure is raised again and caught; ``reset_models``: as the session did after it.
    replay: dict | None = None
    failed: bool = False
    reset_models: bool = False
    execution_count: int | None = None
    cell_id: str | None = None


@dataclass
class JobPlan:
    """What a job holds, and what its header says."""

    session_id: str
    nprocs: int
    backend: str
    env: dict
    steps: list[JobStep] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # "In [7]: failed (...)": not in the job
    notes: list[str] = field(default_factory=list)  # in the job, and worth knowing
    stopped: bool = False  # a stopped cell was left out: the job may differ from the session
    versions: dict = field(default_factory=dict)
    notebook: str | None = None  # the notebook file, where the front end said
    runs: list = field(default_factory=list)  # (cellId, execution count, source) of every session cell, in order
    cells: tuple[int, int] | None = None  # the range asked for (--cells A-B)
    origin: str = ""  # what was exported: "session <id>", or the notebook's one-shot cells
    one_shot: bool = False  # the notebook's one-shot cells, not a session's
    as_ran: bool = False  # stopped and failed cells are replayed to where they ended, where they can be
    replayed: list[str] = field(default_factory=list)  # "In [8]: stopped ...": in the job, replayed
    replayable: int = 0  # cells left out that --as-ran would replay


def unexportable_reason(source: str) -> str | None:
    """Why a session cell's source can't run in a job, or None."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return f"it does not parse ({exc.msg})"
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in _KERNEL_ONLY:
            return _KERNEL_ONLY[node.id]
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n in ("pdb", "ipdb") for n in names):
                return "it uses the debugger (pdb)"
    return None


def plan_job(inc, cells: tuple[int, int] | None = None, as_ran: bool = False) -> JobPlan:
    """The job of ``inc``'s history (or of the cells numbered ``cells[0]``..``cells[1]``, by the
    notebook's execution count, else the session's cell number). ``as_ran``: a cell that was stopped
    at a point every rank agreed on, or that failed, goes in too, replayed to where it ended
    (:mod:`nbdist.worker.cell_reach`); else it is left out, as one that can't be replayed is."""
    plan = _new_plan(f"session {inc.session_id}", inc.session_id, inc.nprocs, inc.options.backend,
                     dict(inc.options.env or {}), cells)
    plan.as_ran = as_ran
    _add_records(plan, inc.history.records())
    return plan


def plan_one_shot_job(records: list[CellRecord], nprocs: int | None = None,
                      cells: tuple[int, int] | None = None) -> JobPlan:
    """The job of a kernel's one-shot cells (no session): each a step run as on fresh ranks. The
    job's rank count is ``nprocs``, else the one most of the cells that finished ran on; a cell that
    ran on another count is left out, and said."""
    ran = [r.nprocs for r in records if r.status == "finished"] or [r.nprocs for r in records] or [1]
    nprocs = nprocs or max(set(ran), key=ran.count)
    plan = _new_plan("the notebook's one-shot %%distributed cells (no session)", "one-shot", nprocs, "auto", {},
                     cells)
    plan.one_shot = True
    _add_records(plan, records)
    if plan.steps:
        plan.notes.append("each one-shot cell ran on ranks started for it: the job runs them one after the other "
                          "in one world (what an earlier cell made is still there; a cell that draws random "
                          "numbers without a seed draws others, as a new run of it would)")
    return plan


def _new_plan(origin: str, session_id: str, nprocs: int, backend: str, env: dict,
              cells: tuple[int, int] | None) -> JobPlan:
    return JobPlan(session_id, nprocs, backend, env, origin=origin, cells=cells,
                   versions={"python": platform.python_version(), "torch": _version_of("torch"),
                             "nbdist": _version_of("nbdist")})


def _add_records(plan: JobPlan, records: list[CellRecord]) -> None:
    cells = plan.cells
    for record in records:
        number = record.execution_count if record.execution_count is not None else record.number
        if cells is not None and not cells[0] <= number <= cells[1]:
            continue
        if record.what == "code":
            plan.runs.append((record.cell_id, record.execution_count, record.source))
        why = _why_left_out(record, plan.nprocs)
        replay = why is not None and _replayable(record, plan.nprocs)
        if replay and plan.as_ran:
            plan.steps.append(_replayed_step(plan, record))
            continue
        if why is not None:
            if plan.as_ran and record.status in ("interrupted", "failed"):
                why += "; it can't be replayed: a rank stopped where it was (no collective every rank agreed on), or died"
            plan.left_out.append(f"{record.label}: {why}")
            plan.stopped |= record.status == "interrupted"
            plan.replayable += replay
            continue
        plan.steps.append(_step_of(record, plan.nprocs))


def _replayable(record: CellRecord, nprocs: int) -> bool:
    """A stopped or failed cell whose every rank said how far it got, and that would go in had it finished."""
    if record.status not in ("interrupted", "failed") or not record.reached:
        return False
    return _why_unexportable(record, nprocs) is None


def _replayed_step(plan: JobPlan, record: CellRecord) -> JobStep:
    step = _step_of(record, plan.nprocs)
    step.replay, step.failed, step.reset_models = dict(record.reached), record.status == "failed", record.models_reset
    how = (f"failed ({record.error_line})" if record.error_line else "failed") if step.failed else "stopped"
    step.label += f" · {how} in the session: replayed to where it ended"
    plan.replayed.append(f"{record.label}: {how}")
    return step


def _version_of(package: str) -> str:
    """A package's installed version, without importing it (the kernel never imports torch)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _why_left_out(record: CellRecord, nprocs: int) -> str | None:
    status = record.status
    if status == "failed":
        return f"it failed{f' ({record.error_line})' if record.error_line else ''}"
    if status == "interrupted":
        return "it was stopped (it may have changed the ranks' state before it stopped)"
    if status != "finished":
        return f"it was {status} when exported"
    return _why_unexportable(record, nprocs)


def _why_unexportable(record: CellRecord, nprocs: int) -> str | None:
    """Why a cell can't run in the job, however it ended."""
    if record.what in ("heal", "sync"):
        return None
    if record.what == "values":
        return (f"it set {', '.join(record.value_names)} from code (Session.push/scatter); the job can't hold "
                f"those values: set them in a cell")
    if record.nprocs is not None and record.nprocs != nprocs:
        return f"it ran on {record.nprocs} ranks of its own; the job runs on {nprocs} (--nprocs)"
    if record.what == "code":
        return unexportable_reason(record.source)
    return None


def _step_of(record: CellRecord, nprocs: int) -> JobStep:
    if record.what == "heal":  # the ranks' DDP models got new reducers, whose first step rebuilds buckets
        return JobStep(f"{record.label} · every rank", "_job.rebuild_ddp_models()  # as the heal did: the same "
                       "collectives in the next step")
    if record.what == "sync":  # the replicas a stop or a --ranks cell left apart are set alike again
        return JobStep(f"{record.label} · every rank", f"_job.sync_replicas({int(record.source)})  # as %dist_sync "
                       "did: every DDP replica and its optimizer from that rank's")
    ranks = None if record.every_rank or sorted(record.ranks) == list(range(nprocs)) else sorted(record.ranks)
    on = "every rank" if ranks is None else f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    label = f"{record.label}{f' · cell {record.cell_id[:8]}' if record.cell_id else ''} · {on}"
    if record.what == "function":
        fn = record.call[0]
        label += f" · Session.run({getattr(fn, '__qualname__', type(fn).__name__)})"
        return JobStep(label, ranks=ranks, call=record.call, execution_count=record.execution_count)
    body = record.source
    if record.magic_line:
        label += f" · %%distributed {record.magic_line}".rstrip()
    if record.nprocs is not None:
        label += " · fresh ranks (one-shot)"
    return JobStep(label, body, ranks, dict(record.modules), record.pushed_file if record.notebook_values else None,
                   list(record.notebook_values), execution_count=record.execution_count, cell_id=record.cell_id)


def write_job(plan: JobPlan, path: str, launcher: str = "torchrun", nprocs: int | None = None,
              nnodes: int = 1) -> list[str]:
    """Write the job: ``path``, its files beside it (``<stem>_files/``) and ``<stem>.sbatch``.
    Returns the paths written. Refuses, in one line, a folder that doesn't exist."""
    from nbdist.protocol.pickling import dump_pickle_checked
    from nbdist.session.job_script import render_sbatch, render_script

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no folder {folder!r} to write the job into")
    if not any(not s.notebook for s in plan.steps):
        where = f" among cells {plan.cells[0]}-{plan.cells[1]}" if plan.cells else ""
        none = ": it ran none there" if plan.cells else ": it has run none yet"
        of = "the notebook's %%distributed cells" if plan.one_shot else "the session"
        raise ValueError(f"no cell of {of}{where} can be exported" +
                         (f" ({'; '.join(plan.left_out)})" if plan.left_out else none))
    stem = os.path.splitext(os.path.basename(path))[0]
    files = os.path.join(folder, f"{stem}_files")
    written, names = [], {}
    for i, step in enumerate(plan.steps):
        if step.values_from is None and step.call is None:
            continue
        os.makedirs(files, mode=0o700, exist_ok=True)
        if step.values_from is not None:
            names[i, "values"] = f"values-{i}.nbv"
            shutil.copyfile(step.values_from, os.path.join(files, names[i, "values"]))
        if step.call is not None:
            names[i, "call"] = f"call-{i}.pkl"
            data = dump_pickle_checked(step.call, f"the function of {step.label.split(' · ')[0]}")
            with open(os.path.join(files, names[i, "call"]), "wb") as fh:
                fh.write(data)
    nprocs = nprocs or plan.nprocs
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render_script(plan, os.path.basename(path), names, launcher, nprocs, nnodes))
    written.append(path)
    sbatch = os.path.join(folder, f"{stem}.sbatch")
    with open(sbatch, "w", encoding="utf-8") as fh:
        fh.write(render_sbatch(plan, os.path.basename(path), nprocs, nnodes))
    written.append(sbatch)
    if os.path.isdir(files):
        written.append(files)
    return written
