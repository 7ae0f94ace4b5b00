"""The notebook's session, from IPython: ``%dist_start``, ``%dist_stop``, ``%dist_restart``,
``%dist_stacks``, ``%dist_autoreload``, and ``%%distributed`` cells that run in the live session.

A session cell carries the kernel's ``%autoreload`` (read from IPython's own ``AutoreloadMagics``:
its mode, ``%aimport`` and ``%aimport -name``) as a plain value, unless ``%dist_autoreload on|off``
overrides it: each rank then reloads its changed modules first (:mod:`nbdist.worker.autoreload`).

A thin front end over :class:`nbdist.Session`, as ``magic.py`` is over runs: it parses flags,
turns a cell into a payload in the session's cell dir, and hands the cell's handle to the same
views a one-shot run gets. One session per kernel.
"""

from __future__ import annotations

import threading
import time

from IPython.core.error import UsageError

from nbdist.errors import LaunchConfigError, SessionLostError
from nbdist.frontend.cell_job import keep_notebook_values
from nbdist.frontend.cell_source import CellSource, find_defined_names
from nbdist.options import WorldOptions
from nbdist.protocol import rundir
from nbdist.protocol.session_channel import Autoreload
from nbdist.session.handle import Session
from nbdist.worker.cell import run_cell

__all__ = ["live_session", "start_session", "stop_session", "restart_session", "show_stacks", "has_stdin", "debug_last_failure",
           "launch_session_cell", "kernel_autoreload", "cell_autoreload", "set_autoreload", "sync_replicas"]

_SESSION: Session | None = None
MAGIC_RESTART_HINT = "%dist_restart brings new ranks"
_AUTORELOAD: bool | None = None  # %dist_autoreload on/off; None: session cells follow the kernel's %autoreload
_MODE_NAMES = {1: "1 (the %aimport-ed modules)", 2: "2 (all modules)", 3: "3 (all modules, and their new names)"}


def live_session() -> Session | None:
    """The notebook's session while it is starting, idle, busy or broken (a broken one says so)."""
    return _SESSION if _SESSION is not None and _SESSION.status != "closed" else None


def start_session(shell, options, start_timeout=None, check_collectives=False, heal=None) -> Session:
    """``%dist_start``: start the ranks in the background and show them come up."""
    global _SESSION
    if live_session() is not None:
        raise UsageError(f"a session is live already ({_describe(_SESSION)}): %dist_stop or %dist_restart first")
    try:
        _SESSION = Session(**options.session_kwargs(), start_timeout=start_timeout,
                           check_collectives=check_collectives, heal=heal)
    except LaunchConfigError as exc:
        raise UsageError(str(exc)) from None
    _SESSION.restart_hint = MAGIC_RESTART_HINT
    _show_coming_up(shell, _SESSION)
    return _SESSION


def stop_session() -> str:
    global _SESSION
    session = live_session()
    if session is None:
        return "nbdist: no session is live"
    n = len(session.pids) or session.nprocs
    session.close()
    _SESSION = None
    return f"nbdist: session {session.session_id} stopped ({n} ranks); nothing of it is left running"


def restart_session(shell) -> Session:
    session = _SESSION
    if session is None:
        raise UsageError("no session to restart: %dist_start first")
    session.restart()
    _show_coming_up(shell, session)
    return session


def has_stdin(shell) -> bool:
    """Whether the front end answers ``input()`` (a notebook or terminal; not nbconvert or nbclient)."""
    kernel = getattr(shell, "kernel", None)
    return True if kernel is None else bool(getattr(kernel, "_allow_stdin", False))


def debug_last_failure(shell, rank: int | None = None) -> None:
    """``%dist_debug``: post-mortem pdb on the rank that failed first in the last failed cell (or ``rank``)."""
    from nbdist.frontend.debugger_prompt import answer_debug_prompts
    from nbdist.worker.debugger import post_mortem

    session = live_session()
    if session is None or session.status != "idle":
        raise UsageError("%dist_debug debugs an idle session's last failed cell (%dist_start; wait for a busy cell)")
    inc = session.incarnation
    rank = inc.last_failed_rank if rank is None else rank
    if rank is None or rank not in inc.pids:
        raise UsageError("no failed cell to debug in this session" if rank is None
                         else f"there is no rank {rank} in this session ({session.nprocs} ranks)")
    if not has_stdin(shell):
        print("nbdist: %dist_debug needs a stdin (a notebook or a terminal); this front end has none")
        return
    handle = session._submit(lambda cell_dir, held: rundir.pack_payload(post_mortem, sources_held=held),
                             [rank], None, stdin=True)
    try:
        while not handle.done:
            answer_debug_prompts(handle)
            handle._done.wait(0.1)
    except KeyboardInterrupt:
        handle.interrupt()
        return
    if not handle.wait().get(rank):
        print(f"nbdist: rank {rank} has no failed cell to debug (a rank keeps its last failure until its next cell)")


def sync_replicas(src: int) -> str:
    """``%dist_sync``: the live session's DDP replicas and their optimizers, re-synced from rank ``src``."""
    session = live_session()
    if session is None or session.status != "idle":
        raise UsageError("%dist_sync re-syncs an idle session's ranks (%dist_start); "
                         + ("wait for its cell, or stop it" if session is not None and session.status == "busy"
                            else "there is none now"))
    try:
        return session.sync(src)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def heal_session(donor) -> str:
    """``%dist_heal``: the live session's dead ranks, brought back from ``donor`` (default: the lowest survivor)."""
    session = live_session()
    if session is None:
        raise UsageError("%dist_heal heals a session's dead ranks (%dist_start); there is none now")
    try:
        return f"nbdist: {session.heal(donor)}"
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None


def show_stacks() -> None:
    """``%dist_stacks``: every rank's Python stack, now, without stopping anything."""
    session = live_session()
    if session is None or session.status in ("starting", "broken"):
        raise UsageError("%dist_stacks shows a live session's ranks (%dist_start); a one-shot run dumps its "
                         "stacks with --timeout")
    dumps, collectives = session.stacks(), session.collectives()
    for rank, pid in session.pids.items():
        dump, report = dumps.get(rank), collectives.get(rank)
        if dump is None:
            print(f"===== rank {rank} (pid {pid}): no stack came back (is it stuck outside Python?)")
        else:
            print(f"===== rank {rank} (pid {pid}): {dump.where}")
        if report is not None:  # beside the stack: the collective it waits in, from its flight recorder
            print(f"  collective: {report['open'][0] if report['open'] else 'none open'}"
                  + (f" (last: {report['last'][-1]})" if report["last"] and not report["open"] else ""))
            for entry in report.get("torch", []):  # what the GPU does, where NCCL is in use
                print(f"  torch's NCCL flight recorder: {entry}")
        if dump is not None:
            print(dump.main)


def kernel_autoreload(shell) -> Autoreload | None:
    """The kernel's ``%autoreload`` as a plain value for the ranks: None while it is off or not loaded."""
    registry = getattr(getattr(shell, "magics_manager", None), "registry", None) or {}
    reloader = getattr(registry.get("AutoreloadMagics"), "_reloader", None)
    if reloader is None or not getattr(reloader, "enabled", False):
        return None
    mode = 3 if getattr(reloader, "autoload_obj", False) else 2 if getattr(reloader, "check_all", True) else 1
    return Autoreload(mode, tuple(getattr(reloader, "modules", ())), tuple(getattr(reloader, "skip_modules", ())))


def cell_autoreload(shell) -> Autoreload | None:
    """What a session cell's ranks reload first: as ``%dist_autoreload`` says, else as the kernel's ``%autoreload``."""
    if _AUTORELOAD is None:
        return kernel_autoreload(shell)
    if not _AUTORELOAD:
        return None
    kernel = kernel_autoreload(shell)  # on: every changed module, but those the kernel skips (%aimport -name)
    return Autoreload(2, (), kernel.skip if kernel is not None else ())


def set_autoreload(shell, word: str) -> str:
    """``%dist_autoreload [on|off|kernel]``: set it (``kernel``: follow the kernel's ``%autoreload``
    again); say what session cells reload now."""
    global _AUTORELOAD
    word = word.strip().lower()
    choices = {"on": True, "1": True, "true": True, "off": False, "0": False, "false": False,
               "kernel": None, "auto": None}
    if word not in choices and word:
        raise UsageError(f"%dist_autoreload takes on, off or kernel (follow the kernel's %autoreload), got {word!r}")
    if word:
        _AUTORELOAD = choices[word]
    rule = cell_autoreload(shell)
    kernel = kernel_autoreload(shell)
    said = ("%dist_autoreload " + ("on" if _AUTORELOAD else "off") if _AUTORELOAD is not None
            else "as the kernel's %autoreload" + ("" if kernel is not None else ", which is off or not loaded"))
    if rule is None:
        what = "reload nothing"
    else:
        what = ("first reload, on every rank, the modules that changed on disk: mode "
                f"{_MODE_NAMES.get(rule.mode, rule.mode)}")
        if rule.mode == 1:
            what += f": {', '.join(rule.modules) or 'none yet'}"
        if rule.skip:
            what += f"; skipped: {', '.join(rule.skip)}"
    return f"nbdist: session cells {what} ({said})"


def describe_dead_ranks() -> str:
    """For ``%dist_ps``: the live session's ranks that died (no process is left to list), or ""."""
    session = live_session()
    if session is None or not session.gone:
        return ""
    lines = [f"session {session.session_id} is {session.status}: rank {r} {how}; gone, the survivors keep their "
             f"state (%dist_heal brings it back)" for r, how in session.gone.items()]
    return "\n" + "\n".join(lines)


def _describe(session: Session) -> str:
    how = session.options.launcher if session.options.launcher != "auto" else "spawn"
    return f"{session.nprocs} ranks, {how}, {session.status}"


def _show_coming_up(shell, session: Session) -> None:
    """One line now; in a kernel, a line per rank that follows the ranks until they are up."""
    print(f"nbdist: session {session.session_id} starting {session.nprocs} ranks; cells now run in it "
          f"(--fresh for one-shot ranks)")
    _follow_ranks(shell, session)


def _follow_ranks(shell, session: Session) -> None:
    """In a kernel, a line per rank that follows the ranks until they are up (a widget)."""
    if getattr(shell, "kernel", None) is None:
        return
    import ipywidgets as w
    from IPython.display import display

    status = w.HTML(_ranks_html(session))
    display(status)

    def follow():
        deadline = time.monotonic() + 300
        while session.status == "starting" and time.monotonic() < deadline:
            time.sleep(0.2)
            status.value = _ranks_html(session)
        status.value = _ranks_html(session)

    threading.Thread(target=follow, name="nbdist-session-view", daemon=True).start()


def _ranks_html(session: Session) -> str:
    import html

    import psutil

    rows = []
    for rank in range(session.nprocs):
        pid = session.pids.get(rank)
        try:
            mem = f"{psutil.Process(pid).memory_info().rss / 2**20:.0f} MiB" if pid else ""
        except psutil.NoSuchProcess:
            mem = "gone"
        state = "up" if pid else "starting"
        rows.append(f"<tr><td>rank {rank}</td><td>{state}</td><td>{pid or '-'}</td><td>{mem}</td></tr>")
    # A snapshot of how the start went, not a live status (later cells have their own views).
    if session.status == "starting":
        head = "starting"
    elif session.lost_reason:
        head = "could not start"
    else:
        head = f"{len(session.pids)} ranks up in {session.ready_after:.1f} s" if session.ready_after else "up"
    note = f"<div>{html.escape(session.lost_reason)}</div>" if session.lost_reason else ""
    return (f"<div style='font-size:12px'><b>nbdist</b> session <code>{session.session_id}</code> · "
            f"{head}<table>{''.join(rows)}</table>{note}</div>")


def _check_same_world(session: Session, args) -> None:
    # The flags that define a world: a cell's must match the live session's (a default means "any").
    shape = WorldOptions.shape_defaults()
    asked = {name: getattr(args, name) for name, default in shape.items() if getattr(args, name) != default}
    differ = [f"--{k.replace('_', '-')} {v}" for k, v in asked.items() if getattr(session.options, k) != v
              and not (k == "nprocs" and v == session.nprocs)]
    if differ:
        raise UsageError(f"this notebook's session has {_describe(session)}; this cell asks for {', '.join(differ)}: "
                         f"%dist_stop (or %dist_restart) first, or --fresh for one-shot ranks")


def _parse_ranks(text) -> list[int] | None:
    if text is None:
        return None
    try:
        return sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UsageError(f"--ranks takes comma-separated rank numbers, got {text!r}") from None


def launch_session_cell(shell, session: Session, args, line: str, cell: str):
    """Start a ``%%distributed`` cell in the live session; return ``(job, cell handle)``.

    Notebook variables the cell reads travel as for a one-shot cell, except names that earlier
    cells defined on the ranks: the ranks' own value wins there (``--push`` still sends it).
    """
    from nbdist.frontend.cell_job import split_names, world_options, write_cell, write_cell_record

    _check_same_world(session, args)
    ranks = _parse_ranks(args.ranks)
    push, pull = split_names(args.push, "--push"), split_names(args.pull, "--pull")
    options = world_options(args)
    inc = session.incarnation  # the ranks this cell goes to, whatever a restart does meanwhile
    if inc.status == "starting":  # the cell waits for the ranks, and shows them come up meanwhile
        print(f"nbdist: this cell waits for session {inc.session_id}'s ranks to come up "
              f"({len(inc.pids)} of {inc.nprocs} up so far)")
        _follow_ranks(shell, session)
    try:
        targets = inc.prepare(ranks)  # a cell sent while the session starts waits for it
    except SessionLostError as exc:
        raise UsageError(f"{exc.reason} (--fresh runs this cell on one-shot ranks)") from None
    except (LaunchConfigError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    cell_dir = inc.new_cell_dir()
    try:
        job = write_cell(shell, args, options, None, CellSource(line, cell), f"{inc.session_id}", cell_dir, push,
                         pull, on_ranks=inc.defined_names, write_source=False)
        kept = keep_notebook_values(job)  # before the cell can end: its end deletes what it was sent
        payload, sent = rundir.pack_payload(run_cell, (job.cell_file, bool(job.pushed), job.modules, job.pull,
                                                      job.source_text), {}, sources_held=inc.sources_held)
        handle = inc.start_cell(cell_dir, targets, payload, args.timeout,
                                check_collectives=args.check_collectives or session.check_collectives,
                                stdin=has_stdin(shell) and not args.bg, autoreload=cell_autoreload(shell))
    except BaseException:
        rundir.discard_run_dir(cell_dir)
        raise
    write_cell_record(job)  # the ranks have the source already: its record is not on their way
    inc.note_sources_sent(targets, sent)
    _record_cell(shell, inc, handle, job, ranks, line, cell, kept)
    inc.defined_names |= find_defined_names(job.tree)
    shell.user_ns["_dist"] = handle
    return job, handle


def _record_cell(shell, inc, handle, job, ranks, line: str, cell: str, kept: str | None) -> None:
    """The cell in its incarnation's history, with the notebook cell that sent it (for %dist_export)."""
    from nbdist.frontend.notebook_cells import current_cell_id
    from nbdist.session.cell_history import CellRecord

    text = cell if cell.endswith("\n") else cell + "\n"
    inc.history.add(CellRecord(handle.cell_id, list(handle.targets), ranks is None, source=text, magic_line=line,
                               notebook_values=list(job.pushed), modules=dict(job.modules), pushed_file=kept,
                               execution_count=getattr(shell, "execution_count", None),
                               cell_id=current_cell_id()).follow(handle))
