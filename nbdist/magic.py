"""IPython front end: ``%%distributed``, ``%dist_ps``, ``%dist_kill`` and ``%dist_logs``.

Thin, like ipyparallel's magics: parse options with ``magic_arguments``, turn the cell into a
payload, pick a view, wait, and translate the notebook's interrupt into ``Run.interrupt()``.
All lifecycle logic stays in :mod:`nbdist.run` and :mod:`nbdist.start`.

In a Jupyter kernel a ``%%distributed`` cell runs as an *awaiting* cell (an input transformer
rewrites it into ``await nbdist.magic.run_cell_async(...)``): the kernel's event loop stays free,
so the view's Kill button is handled while the cell is still running, and the stop button
cancels the wait, which stops the run. Terminal IPython runs the same steps synchronously.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import os
import re
import types
from dataclasses import dataclass, field

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import payload
from .api import kill, ps
from .cell import PULL_FILE, CellSource, find_read_names, run_cell
from .cli import describe_template, format_table, sort_procs
from .errors import LaunchConfigError
from .options import WorldOptions
from .view import FLUSH_INTERVAL, make_view

__all__ = ["DistributedMagics", "load_ipython_extension", "unload_ipython_extension", "run_cell_async"]

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CELL_HEAD = re.compile(r"^%%distributed(\s|$)")


@dataclass
class CellJob:
    """A parsed, checked cell, ready to start: everything is validated before a process exists."""

    args: object
    options: WorldOptions
    engine: object  # the engine launcher (torchrun, mpirun, srun), or None for spawn/attach
    run_id: str
    run_dir: str
    cell_file: str
    pushed: dict = field(default_factory=dict)  # name -> pickled bytes
    modules: dict = field(default_factory=dict)  # name -> module name
    pull: list = field(default_factory=list)
    channel: object = None  # set when each kernel of an attached world spawns its own ranks


def _split_names(text: str, option: str) -> list[str]:
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    bad = [n for n in names if not _IDENT.match(n)]
    if bad:
        raise UsageError(f"{option} takes comma-separated variable names, got {', '.join(map(repr, bad))}")
    return names


def _parse_env(items) -> dict:
    env = {}
    for item in [x for group in (items or []) for x in group]:
        key, sep, value = item.partition("=")
        if not sep or not _IDENT.match(key):
            raise UsageError(f"--env takes KEY=VALUE pairs, got {item!r}")
        env[key] = value
    return env


def prepare_cell(shell, magic_fn, line: str, cell: str) -> CellJob:
    """Parse and check the options, write ``cell.py``, and pick and check what to push.

    Everything that can be refused is refused here, before any process exists; a refused cell
    leaves no run dir behind.
    """
    args = parse_argstring(magic_fn, line)
    push = _split_names(args.push, "--push")
    pull = _split_names(args.pull, "--pull")
    options = WorldOptions.from_magic_args(args)
    options.env = _parse_env(args.env)
    try:
        engine = options.check().make_engine()
    except LaunchConfigError as exc:
        raise UsageError(str(exc)) from None
    source = CellSource(line, cell)
    run_id = payload.new_run_id()
    run_dir = payload.create_run_dir(run_id, args.run_dir)
    try:
        return _write_cell(shell, args, options, engine, source, run_id, run_dir, push, pull)
    except BaseException:
        payload.discard_run_dir(run_dir)
        raise


def _write_cell(shell, args, options, engine, source, run_id, run_dir, push, pull) -> CellJob:
    cell_file = os.path.join(run_dir, "cell.py")
    payload.write_private(cell_file, source.text.encode("utf-8"))
    tree = source.parse(cell_file)  # a SyntaxError names cell.py and the editor's line
    user_ns = shell.user_ns
    hidden = getattr(shell, "user_ns_hidden", {})
    missing = [n for n in push if n not in user_ns]
    if missing:
        raise UsageError(f"--push: no variable named {', '.join(map(repr, missing))} in the notebook")
    job = CellJob(args, options, engine, run_id, run_dir, cell_file, pull=pull)
    # Only names the cell reads travel: an unpicklable, unrelated notebook variable never matters.
    for name in sorted(find_read_names(tree) | set(push)):
        if name not in user_ns or (name in hidden and name not in push):
            continue
        value = user_ns[name]
        if isinstance(value, types.ModuleType):
            job.modules[name] = value.__name__  # re-imported by name in the rank
            continue
        try:
            job.pushed[name] = payload.dump_pickle_checked(value, f"notebook variable {name!r}")
        except TypeError as exc:
            raise UsageError(f"{exc} (or name it in neither the cell nor --push)") from None
    return job


def start_cell(shell, job: CellJob):
    """Start the ranks for a prepared cell; ``_dist`` is the Run from now on."""
    from .start import start_run

    rank_args = (job.cell_file, job.pushed, job.modules, job.pull)
    world = _attached(job)
    if world is not None:  # --nprocs in a kernel that is a rank: each kernel spawns its own ranks
        from .launchers.attach import start_per_kernel

        run, job.channel = start_per_kernel(run_cell, rank_args, {}, world, job.options, run_id=job.run_id,
                                            run_dir=job.run_dir)
    else:
        run = start_run(run_cell, rank_args, {}, job.options, launcher=job.engine, run_id=job.run_id,
                        run_dir=job.run_dir)
    shell.user_ns["_dist"] = run
    return run


def finish_cell(shell, job: CellJob, run):
    """Bring back ``--pull`` variables and return rank 0's value (the cell's result)."""
    import pickle

    if job.channel is not None:
        from .launchers.attach import gather_per_kernel

        results = gather_per_kernel(run, job.channel)  # every kernel gets every rank's value
    else:
        results = run.wait()
    if job.pull:
        try:
            with open(os.path.join(job.run_dir, PULL_FILE), "rb") as fh:
                pulled = pickle.load(fh)
        except FileNotFoundError:
            pulled = {"values": {}, "missing": job.pull}
        for name, blob in pulled["values"].items():
            shell.user_ns[name] = pickle.loads(blob)
        if pulled["missing"]:
            print(f"nbdist: --pull: rank 0 has no variable named {', '.join(pulled['missing'])}")
    first = min(results) if results else None
    return results.get(first) if first is not None else None


def _run_attached_cell(shell, job: CellJob):
    """The kernel already is a rank: run the cell here, in the notebook's own namespace."""
    from .api import launch

    results = launch(run_cell, job.cell_file, {}, {}, [], launcher="attach", backend=job.args.backend,
                     init_process_group=not job.args.no_init)
    return results.get(0)


def _attached(job: CellJob):
    """The world this kernel is a rank of (None when it runs alone or spawns regardless)."""
    from .world import detect_world

    if job.args.launcher not in ("auto", "attach"):
        return None
    world = detect_world()
    if job.args.launcher == "attach" and world is None:
        raise UsageError("--launcher attach: this kernel is not a rank of a torchrun, MPI or Slurm world")
    return world


def _show(view) -> None:
    from IPython.display import display

    if hasattr(view, "widget"):
        display(view.widget)


def _stop_and_raise(run, view):
    run.interrupt()
    view.flush(final=True)
    raise run.error from None


def _launch_cell(shell, line: str, cell: str):
    """Prepare and start the cell; return ``(job, run, view)``, or ``(job, None, value)`` when the
    kernel is itself a rank and ran the cell in place."""
    job = prepare_cell(shell, DistributedMagics.distributed, line, cell)
    if _attached(job) is not None and not job.args.nprocs:
        return job, None, _run_attached_cell(shell, job)
    run = start_cell(shell, job)
    view = make_view(run, job.args.view)
    _show(view)
    if job.args.bg:
        view.start_flusher()
    return job, run, view


def run_cell_sync(shell, line: str, cell: str):
    """The cell, run by the plain cell magic (terminal IPython, or ``%autoawait off``)."""
    job, run, view = _launch_cell(shell, line, cell)
    if run is None or job.args.bg:
        return view if run is None else None
    try:
        while not run.done:
            view.flush()
            run._done.wait(FLUSH_INTERVAL)  # wakes the moment the run ends, not at the next tick
    except KeyboardInterrupt:
        _stop_and_raise(run, view)
    view.flush(final=True)
    return finish_cell(shell, job, run)


def _ended_event(run) -> asyncio.Event:
    """An asyncio event of this loop that the run's monitor thread sets when the run ends."""
    from .run import TERMINAL, RunEvent

    loop, ended = asyncio.get_running_loop(), asyncio.Event()

    def on_event(event):
        if isinstance(event, RunEvent) and event.rank is None and event.status in TERMINAL:
            loop.call_soon_threadsafe(ended.set)

    run.subscribe(on_event)  # replayed: a run that already ended sets it at once
    return ended


async def run_cell_async(line: str, cell: str):
    """The cell in a Jupyter kernel: awaiting, so widgets (the Kill button) stay live."""
    from IPython import get_ipython

    shell = get_ipython()
    job, run, view = _launch_cell(shell, line, cell)
    if run is None or job.args.bg:
        return view if run is None else None
    ended = _ended_event(run)
    try:
        while not run.done:
            view.flush()
            # Wake the moment the run ends (a warm cell takes tens of ms), else draw every tick.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ended.wait(), FLUSH_INTERVAL)
    except (asyncio.CancelledError, KeyboardInterrupt):
        # The stop button: ipykernel cancels an awaiting cell instead of raising KeyboardInterrupt.
        _stop_and_raise(run, view)
    view.flush(final=True)
    return finish_cell(shell, job, run)


def _rewrite_distributed_cell(lines: list[str]) -> list[str]:
    """Input transformer: a ``%%distributed`` cell becomes an awaiting call in a Jupyter kernel."""
    if not lines or not _CELL_HEAD.match(lines[0]):
        return lines
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None or not getattr(shell, "autoawait", False):
        return lines
    magic_line = lines[0][len("%%distributed"):].strip()
    body = "".join(lines[1:])
    return [f"await __import__('nbdist.magic', fromlist=['run_cell_async']).run_cell_async({magic_line!r}, {body!r})\n"]


@magics_class
class DistributedMagics(Magics):
    """``%%distributed`` and the tools to find and stop what runs are left."""

    @magic_arguments()
    @argument("-n", "--nprocs", type=int, default=None,
              help="number of ranks (default: the number of GPUs, or 2 without one)")
    @argument("--launcher", default="auto", help="auto, spawn, attach, torchrun, mpirun or srun")
    @argument("--launcher-args", default="", help="extra engine arguments, quoted: --launcher-args '--hostfile h'")
    @argument("--nnodes", type=int, default=1, help="torchrun: nodes (kernels) in the world; srun: -N")
    @argument("--node-rank", type=int, default=0, help="torchrun: this kernel's node")
    @argument("--master-addr", default=None,
              help="where ranks reach the kernel (default 127.0.0.1, or this machine's address when ranks may run "
                   "elsewhere); torchrun: node 0's address")
    @argument("--master-port", type=int, default=None, help="torchrun with --nnodes > 1: the rendezvous port")
    @argument("--backend", default="auto", help="auto (nccl with CUDA, else gloo), gloo or nccl")
    @argument("--timeout", type=float, default=None, help="seconds; then dump every rank's stack and stop")
    @argument("--bg", action="store_true", help="return at once; use _dist.wait() / _dist.kill() later")
    @argument("--push", default="", help="comma-separated notebook variables to send besides those the cell reads")
    @argument("--pull", default="", help="comma-separated variables to bring back from rank 0")
    @argument("--no-init", action="store_true", help="don't initialise the process group")
    @argument("--env", nargs="+", action="append", default=[], metavar="K=V", help="environment for the ranks")
    @argument("--view", default="auto", choices=("auto", "widget", "text"), help="how to show the ranks' output")
    @argument("--start", default=None, choices=("warm", "spawn", "fork"),
              help="how the ranks are made (default: warm once the template is ready, else spawn)")
    @argument("--run-dir", default=None, help="folder for the run dir (default $NBDIST_RUN_DIR or a private temp dir)")
    @cell_magic
    def distributed(self, line, cell):
        """Run this cell on N PyTorch ranks, with each rank's output live.

        The cell's last expression on each rank is in ``_dist.results``; rank 0's is the cell's
        result. ``_dist`` is the last :class:`nbdist.Run`.

        Examples
        --------
        ::

            %%distributed --nprocs 4 --pull loss
            import torch.distributed as dist
            loss = train(model)          # train and model come from the notebook
            dist.get_rank()
        """
        return run_cell_sync(self.shell, line, cell)

    @line_magic
    def dist_ps(self, line):
        """Show leftover processes of any run (this kernel's or a dead kernel's), with Kill all."""
        procs = ps(line.strip() or None)
        if getattr(self.shell, "kernel", None) is None:
            print(format_table(procs))
            return None
        import ipywidgets as w

        table = w.HTML(_procs_html(procs))
        button = w.Button(description="Kill all", icon="stop", button_style="danger",
                          disabled=not procs, layout=w.Layout(width="90px"))
        status = w.HTML()

        def on_click(_):
            button.disabled = True
            n = kill(line.strip() or None)
            status.value = f"<span style='font-size:12px'>stopped {n} process{'es' if n != 1 else ''}</span>"
            table.value = _procs_html(ps(line.strip() or None))

        button.on_click(on_click)
        from IPython.display import display

        display(w.VBox([table, w.HBox([button, status])]))
        print(format_table(procs))
        return None

    @line_magic
    def dist_warm(self, line):
        """``%dist_warm [--refresh] [MODULE ...]``: start or refresh the warm template, preloading MODULEs.

        Ranks forked from it start in milliseconds. ``%dist_warm --off`` ends it (launches spawn).
        """
        from . import warmstart as warm

        words = line.split()
        if "--off" in words:
            warm.close_templates()
            print("nbdist: warm start is off for this kernel until %dist_warm")
            return None
        modules = [w for w in words if not w.startswith("-")]
        bad = [m for m in modules if not all(_IDENT.match(part) for part in m.split("."))]
        if bad:
            raise UsageError(f"%dist_warm takes module names, got {', '.join(map(repr, bad))}")
        template = warm.warm(preload=modules, refresh="--refresh" in words, wait=True)
        took = f" in {template.ready_after:.1f} s" if template.ready_after else ""
        failed = template.info.get("failed") or []
        print(f"nbdist: {template.describe()}{took}; preload: {', '.join(template.preload) or '(torch only)'}")
        for line_ in failed:
            print(f"nbdist: preload failed: {line_}")
        return None

    @line_magic
    def dist_kill(self, line):
        """``%dist_kill [RUN_ID]``: stop the processes of one run, or of every run."""
        n = kill(line.strip() or None)
        print(f"stopped {n} process{'es' if n != 1 else ''}")

    @line_magic
    def dist_logs(self, line):
        """``%dist_logs [RUN_ID] [RANK]``: print the logs of the last run (or of RUN_ID)."""
        parts = line.split()
        run = self.shell.user_ns.get("_dist")
        if parts and not parts[0].isdigit():
            run_dir = os.path.join(payload.choose_runs_root(), parts.pop(0))
        elif run is not None:
            run_dir = run.run_dir
        else:
            raise UsageError("no run yet: give a RUN_ID (see %dist_ps)")
        if not os.path.isdir(run_dir):
            raise UsageError(f"no run dir at {run_dir}")
        ranks = sorted(payload.read_pids(run_dir)) or [0]
        if parts:
            ranks = [int(parts[0])]
        for rank in ranks:
            for stream in ("stdout", "stderr"):
                path = payload.log_path(run_dir, rank, stream)
                if os.path.exists(path) and os.path.getsize(path):
                    with open(path, encoding="utf-8", errors="replace") as fh:
                        print(f"===== rank {rank} {stream} ({path})\n{fh.read()}", end="")


def _procs_html(procs) -> str:
    ranks = [p for p in procs if not p.is_template]
    notes = "".join(f"<div style='font-size:12px;color:#666'>{html.escape(describe_template(p))}</div>"
                    for p in sort_procs([p for p in procs if p.is_template]))
    if not ranks:
        return f"<span style='font-size:12px'>no nbdist ranks are running</span>{notes}"
    head = "".join(f"<th style='text-align:left;padding:2px 10px'>{h}</th>"
                   for h in ("run id", "rank", "pid", "age", "memory", "command"))
    rows = []
    for p in sort_procs(ranks):
        cells = (p.run_id, "-" if p.rank is None else p.rank, p.pid, f"{p.age:.0f} s",
                 f"{p.rss / 2**20:.0f} MiB", p.cmdline[:70])
        rows.append("<tr>" + "".join(f"<td style='padding:2px 10px'><code>{html.escape(str(c))}</code></td>"
                                     for c in cells) + "</tr>")
    return f"<table style='font-size:12px'><tr>{head}</tr>{''.join(rows)}</table>{notes}"


def load_ipython_extension(ipython) -> None:
    from .warmstart import start_in_background

    ipython.register_magics(DistributedMagics)
    start_in_background()  # the template imports torch while the user writes the first cell
    if _rewrite_distributed_cell not in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.append(_rewrite_distributed_cell)


def unload_ipython_extension(ipython) -> None:
    if _rewrite_distributed_cell in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(_rewrite_distributed_cell)
