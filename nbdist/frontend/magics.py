"""IPython front end: ``%%distributed`` and the session magics (``%dist_start``, ``%dist_stop``,
``%dist_restart``, ``%dist_debug``, ``%dist_sync``, ``%dist_heal``, ``%dist_export``, ``%dist_stacks``,
``%dist_autoreload``: thin methods over :mod:`nbdist.frontend.session_magics`); the process magics (``%dist_ps``, ``%dist_kill``, ``%dist_logs``,
``%dist_warm``) are :mod:`nbdist.frontend.process_magics`.

Thin, like ipyparallel's magics: parse options with ``magic_arguments``, turn the cell into a
payload, pick a view, wait, and translate the notebook's interrupt into ``Run.interrupt()``.
All lifecycle logic stays in :mod:`nbdist.run`.

In a Jupyter kernel a ``%%distributed`` cell runs as an *awaiting* cell (an input transformer
rewrites it into ``await nbdist.frontend.magics.run_cell_async(...)``): the kernel's event loop stays free,
so the view's Kill button is handled while the cell is still running, and the stop button
cancels the wait, which stops the run. Terminal IPython runs the same steps synchronously.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import re

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from nbdist.frontend.cell_job import (attached_world, finish_cell, keep_notebook_values, prepare_cell,
                                      run_attached_cell, session_world_arguments, start_cell, world_arguments, world_options)
from nbdist.frontend.process_magics import ProcessMagics
from nbdist.frontend.views import FLUSH_INTERVAL, make_view

__all__ = ["DistributedMagics", "load_ipython_extension", "unload_ipython_extension", "run_cell_async",
           "expand_magic_line"]

_CELL_HEAD = re.compile(r"^%%distributed(\s|$)")


def _show(view) -> None:
    from IPython.display import display

    if hasattr(view, "widget"):
        display(view.widget)


def answer_debug_prompts_of(run, view) -> None:
    """A session cell whose ranks wait in pdb: prompt in the stdin box until none waits (the view
    drawn before each prompt: its badges say which ranks are paused, and where)."""
    if getattr(run, "paused", None):
        from nbdist.frontend.debugger_prompt import answer_debug_prompts

        answer_debug_prompts(run, before_prompt=view.flush)


def _stop_and_raise(run, view):
    run.interrupt()
    view.flush(final=True)
    if run.error is None:  # it finished as the stop came: the stop is still what the user asked for
        raise KeyboardInterrupt
    raise run.error from None


@functools.lru_cache(maxsize=64)
def _parse_cell_line(line: str):
    """``%%distributed``'s options: a notebook repeats a few lines many times, and argparse costs
    a tenth of a millisecond a cell (a line it refuses raises, and is not kept)."""
    return parse_argstring(DistributedMagics.distributed, line)


def _launch_cell(shell, line: str, cell: str):
    """Prepare and start the cell; return ``(job, run, view)``, or ``(job, None, value)`` when the
    kernel is itself a rank and ran the cell in place. A live session takes the cell (unless
    ``--fresh``): ``run`` is then the cell's handle."""
    from nbdist.frontend.one_shot_cells import record_one_shot
    from nbdist.frontend.session_magics import launch_session_cell, live_session

    args = copy.copy(_parse_cell_line(line))  # each cell's own copy: a job keeps and may change it
    session = live_session()
    if session is not None and not args.fresh:
        job, run = launch_session_cell(shell, session, args, line, cell)
    else:
        if args.ranks is not None or args.check_collectives:
            flag = "--ranks" if args.ranks is not None else "--check-collectives"
            raise UsageError(f"{flag} is for a session's cells: %dist_start first")
        job = prepare_cell(shell, args, line, cell)
        if attached_world(job) is not None and not job.args.nprocs:
            return job, None, run_attached_cell(shell, job)
        kept = keep_notebook_values(job)  # before the run can end: its end deletes what it was sent
        run = start_cell(shell, job)
        record_one_shot(shell, job, run, line, cell, kept)  # for %dist_export with no session
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
            answer_debug_prompts_of(run, view)
            run._done.wait(FLUSH_INTERVAL)  # wakes the moment the run ends, not at the next tick
    except KeyboardInterrupt:
        _stop_and_raise(run, view)
    view.flush(final=True)
    return finish_cell(shell, job, run)


def _ended_event(run) -> asyncio.Event:
    """An asyncio event of this loop that the run's monitor thread sets when the run ends."""
    from nbdist.run.events import TERMINAL, RunEvent

    loop, ended = asyncio.get_running_loop(), asyncio.Event()

    def on_event(event):
        if isinstance(event, RunEvent) and event.rank is None and event.status in TERMINAL:
            loop.call_soon_threadsafe(ended.set)

    run.subscribe(on_event)  # replayed: a run that already ended sets it at once
    return ended


def expand_magic_line(shell, line: str) -> str:
    """``line`` with ``{expr}``, ``$name`` and ``$$`` expanded in the notebook's namespace, as IPython
    expands every magic line (``InteractiveShell.var_expand``).

    The awaiting cell bypasses ``run_cell_magic``, which would have done this; its frame's locals are
    nbdist's, so the notebook's namespace is given alone. A line that doesn't format (an undefined
    name) is left as it is, as IPython leaves it: the option's own parse error then names it.
    """
    if "$" not in line and "{" not in line:
        return line
    from IPython.utils.text import DollarFormatter

    try:
        return DollarFormatter().vformat(line, args=[], kwargs=shell.user_ns.copy())
    except Exception:
        return line


async def run_cell_async(line: str, cell: str):
    """The cell in a Jupyter kernel: awaiting, so widgets (the Kill button) stay live."""
    from IPython import get_ipython

    shell = get_ipython()
    line = expand_magic_line(shell, line)  # at run time: the names as they are when the cell runs
    job, run, view = _launch_cell(shell, line, cell)
    if run is None or job.args.bg:
        return view if run is None else None
    ended = _ended_event(run)
    try:
        while not run.done:
            view.flush()
            answer_debug_prompts_of(run, view)  # blocks in input() while ranks wait in pdb
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
    return [f"await __import__('nbdist.frontend.magics', fromlist=['run_cell_async']).run_cell_async({magic_line!r}, {body!r})\n"]


@magics_class
class DistributedMagics(Magics):
    """``%%distributed`` and the tools to find and stop what runs are left."""

    @magic_arguments()
    @world_arguments
    @argument("--timeout", type=float, default=None, help="seconds; then dump every rank's stack and stop")
    @argument("--bg", action="store_true", help="return at once; use _dist.wait() / _dist.kill() later")
    @argument("--push", default="", help="comma-separated notebook variables to send besides those the cell reads")
    @argument("--pull", default="", help="comma-separated variables to bring back from rank 0")
    @argument("--view", default="auto", choices=("auto", "widget", "text"),
              help="auto: a quick cell's lines as a plain cell's, tabs per rank once it runs longer; widget: tabs; "
                   "text: rank-prefixed lines")
    @argument("--ranks", default=None, help="in a session: comma-separated ranks to run on (the others stay idle)")
    @argument("--fresh", action="store_true", help="run on new one-shot ranks even while a session is live")
    @argument("--check-collectives", action="store_true",
              help="in a session: the ranks compare each collective (op, shapes, dtypes) before they issue it")
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

    @magic_arguments()
    @session_world_arguments
    @argument("--start-timeout", type=float, default=None,
              help="seconds the ranks may take to come up (default 120, or 4 per rank); then it says which did not")
    @argument("--check-collectives", action="store_true",
              help="every cell: the ranks compare each collective (op, shapes, dtypes) before they issue it")
    @argument("--heal", choices=("auto", "off"), default="off",
              help="auto: a rank that dies is brought back from its peers at once (off: the heal waits to be asked)")
    @line_magic
    def dist_start(self, line):
        """Start the notebook's session: ranks that live across cells; ``%%distributed`` cells then run in it.

        Returns at once and shows the ranks come up. Variables a cell defines stay on the ranks
        for the next cell; the stop button interrupts the cell and keeps them.

        Examples
        --------
        ::

            %dist_start -n 4
        """
        from nbdist.frontend.session_magics import start_session

        args = parse_argstring(self.dist_start, line)
        start_session(self.shell, world_options(args), start_timeout=args.start_timeout,
                      check_collectives=args.check_collectives, heal=args.heal)

    @line_magic
    def dist_stop(self, line):
        """``%dist_stop``: end the notebook's session; nothing of it is left running."""
        from nbdist.frontend.session_magics import stop_session

        print(stop_session())

    @line_magic
    def dist_restart(self, line):
        """``%dist_restart``: new ranks for the session (the old ones and their state go)."""
        from nbdist.frontend.session_magics import restart_session

        restart_session(self.shell)

    @magic_arguments()
    @argument("--rank", type=int, default=None, help="the rank to debug (default: the one that failed first)")
    @line_magic
    def dist_debug(self, line):
        """``%dist_debug [--rank R]``: pdb in the frame where the session's last failed cell raised.

        On the rank that failed first (or R), with the prompt in the stdin box and the commands of
        ``breakpoint()`` in a session cell. A rank keeps its last failure until its next cell.

        Examples
        --------
        ::

            %dist_debug
            %dist_debug --rank 1
        """
        from nbdist.frontend.session_magics import debug_last_failure

        debug_last_failure(self.shell, parse_argstring(self.dist_debug, line).rank)

    @magic_arguments()
    @argument("--from", dest="src", type=int, default=0, help="the rank whose replica every rank takes (default 0)")
    @line_magic
    def dist_sync(self, line):
        """``%dist_sync [--from R]``: re-sync the session's DDP replicas and their optimizers from one rank.

        After a stop or a ``--ranks`` cell left the replicas apart (the cell's message says so):
        parameters, buffers, every optimizer's state (Adam's moments and step) and its settings come
        from rank R. The ranks compare the structure first and change nothing where it differs; a
        rank whose optimizer has no state yet gets R's.

        Examples
        --------
        ::

            %dist_sync
            %dist_sync --from 1
        """
        from nbdist.frontend.session_magics import sync_replicas

        print(sync_replicas(parse_argstring(self.dist_sync, line).src))

    @magic_arguments()
    @argument("--from", dest="donor", type=int, default=None,
              help="the survivor whose names the new ranks take (default: the lowest)")
    @line_magic
    def dist_heal(self, line):
        """``%dist_heal [--from R]``: bring a degraded session's dead ranks back from their peers.

        Each dead rank starts again (the same rank number, device and environment), joins every
        process group in place (the survivors' groups, DDP models and meshes keep their objects), and
        takes every name that all survivors hold alike from rank R: functions, classes, tensors,
        models, optimizers. Rank-specific names and names that can't be pickled are listed, not copied.

        Examples
        --------
        ::

            %dist_heal
            %dist_heal --from 3
        """
        from nbdist.frontend.session_magics import heal_session

        print(heal_session(parse_argstring(self.dist_heal, line).donor))

    @magic_arguments()
    @argument("path", help="the job script to write (job.py); job.sbatch and job_files/ go beside it")
    @argument("--cells", default=None, help="A-B: only the cells that ran as In [A] to In [B]")
    @argument("--launcher", choices=("torchrun", "srun", "mpirun"), default="torchrun",
              help="the engine the header and the batch file lead with (the script runs under each, and python)")
    @argument("-n", "--nprocs", type=int, default=None,
              help="the job's ranks (default: the session's; without one, what most one-shot cells ran on)")
    @argument("--nnodes", type=int, default=1, help="nodes the job spreads over (torchrun's and the batch file's)")
    @argument("--as-ran", action="store_true",
              help="replay the stopped and failed cells to where they ended (each rank stops at the collective "
                   "it stopped at), so the job's state is the session's")
    @line_magic
    def dist_export(self, line):
        """``%dist_export job.py``: write the session as a job that runs the same under python, torchrun,
        srun and mpirun.

        The script holds the session cells that finished, in the order they ran (a ``--ranks`` cell
        guarded by its ranks), after the notebook cells that define what they read; its header says
        how to run it, what the session ran on, and which cells are left out and why (failed,
        stopped, using ``_dist`` or a debugger). ``job.sbatch`` beside it runs it with srun. With
        ``--as-ran``, a cell that was stopped (at a point every rank agreed on) or failed goes in too,
        replayed to where it ended: each rank stops before the collective it stopped before.

        With no session, the notebook's one-shot ``%%distributed`` cells go out instead, one after the
        other in the job's one world (the quickstart's kind of notebook).

        Examples
        --------
        ::

            %dist_export job.py
            %dist_export jobs/train.py --cells 3-12 --launcher srun --nprocs 8 --nnodes 2
        """
        from nbdist.frontend.export_magic import export_session

        print(export_session(self.shell, parse_argstring(self.dist_export, line)))

    @line_magic
    def dist_stacks(self, line):
        """``%dist_stacks``: every session rank's Python stack, now, without stopping anything."""
        from nbdist.frontend.session_magics import show_stacks

        show_stacks()

    @line_magic
    def dist_autoreload(self, line):
        """``%dist_autoreload [on|off|kernel]``: before each session cell, every rank reloads the modules
        of yours that changed on disk since it imported them (as ``%autoreload 2`` does in the kernel).

        By default session cells follow the kernel's ``%autoreload`` (its mode, ``%aimport`` and
        ``%aimport -name``); ``on`` or ``off`` overrides it, ``kernel`` follows it again. Without an
        argument it says what session cells reload now.

        Examples
        --------
        ::

            %load_ext autoreload
            %autoreload 2          # the kernel and the session's ranks both reload mymodel.py when it changes
            %dist_autoreload off   # the ranks keep the code they imported
        """
        from nbdist.frontend.session_magics import set_autoreload

        print(set_autoreload(self.shell, line))


def load_ipython_extension(ipython) -> None:
    from nbdist.launchers.cuda_watch import watch_cuda_init_when_imported
    from nbdist.launchers.store_host import start_store_host
    from nbdist.warmstart.handle import start_in_background

    from nbdist.frontend.notebook_cells import start_recording

    ipython.register_magics(DistributedMagics)
    ipython.register_magics(ProcessMagics)
    start_recording(ipython)  # the notebook's cells, for %dist_export
    # The kernel never imports torch for a loopback run: the store host holds the runs' stores. Who
    # first initialises CUDA is watched from the user's own `import torch` on.
    watch_cuda_init_when_imported()
    start_store_host()
    start_in_background()  # the template imports torch while the user writes the first cell
    if _rewrite_distributed_cell not in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.append(_rewrite_distributed_cell)


def unload_ipython_extension(ipython) -> None:
    from nbdist.frontend.notebook_cells import stop_recording

    stop_recording()
    if _rewrite_distributed_cell in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(_rewrite_distributed_cell)
