"""The rank side of a session: one turn of "run a payload" becomes a loop that waits for cells.

A session rank starts as any rank does (own group, parent watch, fd capture, env, device,
process group: :mod:`nbdist.worker.bootstrap` did all that before this payload runs), then connects to
the kernel's session channel (authenticated ``multiprocessing.connection``, the key in the
session's 0600 ``session.key``) and serves cells until the kernel says "close" or goes away.

Cells run in the rank's ``__main__``, which lives as long as the rank: what a cell defines is
there for the next one. The stop button reaches a busy rank as SIGINT from the operating system,
never through this loop (which is busy running the cell): SIGINT is let through only while user
code runs, so it interrupts that code and nothing else. One that comes while the rank is idle or
reporting is dropped. Waiting for the next cell is a blocking read: an idle rank uses no CPU.
Standard library plus rundir.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading

from nbdist.protocol import rundir
from nbdist.protocol.session_channel import HEAL_FILE_ENV, read_session_key
from nbdist.protocol.shared_values import dump_shared, load_shared
from nbdist.worker import import_guard
from nbdist.worker.kernel_connect import connect_to_kernel
from nbdist.worker.member_arrival import watch_calls_off
from nbdist.worker.rank_signals import RunningCell, answer_signals, stop_asked as _stop_asked
from nbdist.worker.rank_signals import torch_groups_in_use as _torch_groups_in_use

__all__ = ["serve_session", "set_names", "set_shared_names", "set_shared_piece", "get_name", "count_collectives", "reform_groups", "reset_models", "sync_replicas",
           "degrade_groups"]


def _stop_point_hit() -> bool:
    return "nbdist.worker.stop_point" in sys.modules and sys.modules["nbdist.worker.stop_point"].was_hit()


def _log_offsets() -> tuple[int, int]:
    """Where this rank's stdout and stderr logs end now: a cell's output starts or ends there."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return os.fstat(1).st_size, os.fstat(2).st_size


_KERNEL_HERE = True  # the kernel runs on this machine: big values go through shared memory
_HELD: list = []  # this rank's shared values the kernel may still be mapping (nbdist.protocol.shared_values)
_IN_USER_CODE = False
_CELL_DIR: str | None = None  # the cell the main thread runs: a stop is for it only if its dir asks
_STOPPED = False  # the stop button reached this cell (its error, if any, is the release's)
_WRITING = False  # the main thread is writing a message to the kernel: a stop waits until it is whole
_STOP_HELD = False  # a stop came while it wrote: raised the moment the message is out
_MISSED_STOP = False  # a SIGINT came while no user code ran: maybe the stop of a cell not begun yet


def _on_sigint(signum, frame):
    """The stop button interrupts the user's code and nothing else: one that comes while the rank
    waits for a cell or reports one is dropped (the kernel only sends it to busy ranks), so is one
    meant for an earlier cell that arrives late (the kernel asks in the cell's own dir), and one
    that comes while user code writes to the kernel (a ``display()`` of a big figure goes as a
    header and a body) is held until the message is whole, so the channel never tears. One that
    comes before the cell's code began (the stop pressed as the cell was sent) is noted: the cell
    then stops as it begins, if the stop was for it. One that lands inside an import waits for it
    to end (:mod:`nbdist.worker.import_guard`)."""
    global _STOPPED, _STOP_HELD, _MISSED_STOP
    if not _IN_USER_CODE:
        _MISSED_STOP = True
    elif _stop_asked(_CELL_DIR):
        _STOPPED = True
        if _WRITING:
            _STOP_HELD = True
            return
        cell = _CELL_DIR
        if import_guard.hold(frame, lambda: _IN_USER_CODE and _CELL_DIR == cell):
            return  # an import can't be taken back: the stop comes again as it ends
        raise KeyboardInterrupt


@contextlib.contextmanager
def _stop_held():
    """Hold the stop button while this (main) thread writes one message; then let it through."""
    global _WRITING, _STOP_HELD
    if threading.current_thread() is not threading.main_thread():
        yield  # the handler runs in the main thread only: a write here is never torn by it
        return
    _WRITING = True
    try:
        yield
    finally:
        _WRITING = False
        if _STOP_HELD:
            _STOP_HELD = False
            if _IN_USER_CODE:
                raise KeyboardInterrupt


def _run_one(cell_dir: str, rank: int, payload: bytes | None, reload=None):
    """Run the cell's payload (from its message, else from its dir), interruptible; return
    ``(kind, body)`` for the kernel. ``reload``: the kernel's ``%autoreload``
    (:class:`~nbdist.protocol.session_channel.Autoreload`): the modules that changed on disk are
    reloaded first, and one that can't be is the cell's failure (its code does not run)."""
    global _IN_USER_CODE, _STOPPED, _CELL_DIR, _MISSED_STOP
    from nbdist.worker.exceptions import describe_exception

    import bdb

    from nbdist.worker import debugger
    from nbdist.worker.cell import run_cell

    fn, args, kwargs, _extra = rundir.read_payload(cell_dir, payload)
    users = fn is run_cell or not getattr(fn, "__module__", "").startswith("nbdist.worker.")
    if users:
        # A user's cell or function: %dist_debug shows its failure, not an older one. nbdist's own
        # calls (bringing the ranks in step, pull, post-mortem itself) keep it, and reload nothing.
        debugger.forget_failure()
        if "nbdist.worker.optimizer_steps" in sys.modules:  # the steps a stop compares are this cell's
            sys.modules["nbdist.worker.optimizer_steps"].begin_user_cell()
    else:
        reload = None
    _STOPPED, _CELL_DIR = False, cell_dir
    try:
        try:
            if reload is not None:  # before the stop button may raise: a module is never left half reloaded
                from nbdist.worker.autoreload import reload_changed

                reload_changed(reload)  # a stop meanwhile is noted, and stops the cell just below
            _IN_USER_CODE = True
            if _MISSED_STOP:  # from here on a SIGINT raises; one that came before is checked once
                _MISSED_STOP = False
                if _stop_asked(cell_dir):
                    _STOPPED = True
                    raise KeyboardInterrupt
            value = fn(*args, **kwargs)
        finally:
            _IN_USER_CODE = False
    except (KeyboardInterrupt, bdb.BdbQuit):  # the stop button; or pdb's quit, which the notebook sends for it
        _IN_USER_CODE = False  # the handler may have run before the finally's first line
        return "interrupted", None
    except BaseException as exc:  # SystemExit too: the rank lives on, the cell failed
        _IN_USER_CODE = False
        debugger.remember_failure(exc)
        info = describe_exception(exc)
        if _stop_point_hit():  # stopped at the agreed point; a library turned it into its own error
            return "interrupted", None
        if _STOPPED and info["secondary"]:
            # Stopped in a collective: the session released it by closing the peers' connections.
            return "interrupted", None
        sys.stderr.write(info["traceback"])
        return "failed", info
    try:
        shared = dump_shared(value, f"the value of the cell on rank {rank}", local=_KERNEL_HERE)
    except TypeError as exc:
        return "failed", describe_exception(exc)
    if shared.fds:
        _HELD.append(shared)  # until the kernel has mapped them: its next message
    return "finished", shared


def serve_session(session_dir: str, address) -> None:
    """The session loop of one rank: connect, say hello, run cells until "close" or end-of-file."""
    global _IN_USER_CODE, _KERNEL_HERE
    rank = int(os.environ.get("RANK", "0"))
    spec = rundir.read_spec(session_dir)
    _KERNEL_HERE = spec.kernel_host == socket.gethostname()
    signal.signal(signal.SIGINT, _on_sigint)  # only user code may be interrupted
    watch_calls_off(session_dir)  # a re-forming a member's death called off: stop waiting for it
    address = _join_healed_session(address)
    # Within a deadline, hello included: a kernel that can't be reached ends this rank, saying why.
    conn = connect_to_kernel(address, read_session_key(session_dir), rank)
    lock = threading.Lock()  # a cell's own threads may display while the loop reports
    running = RunningCell()  # the cell running now (its displays, and what a cut may touch)

    def send(message) -> None:
        with lock, _stop_held():
            conn.send(message)

    def send_display(data, metadata) -> None:
        cell_id = running.cell_id
        if cell_id is not None:
            send(("display", rank, cell_id, data, metadata))
        else:  # between cells: the log has it
            print(data.get("text/plain", "<rich output>"))

    from nbdist.worker import debugger, display, stop_point
    from nbdist.worker.autoreload import take_report, track
    from nbdist.worker.cell_reach import attach_reach, group_counts
    from nbdist.worker.namespace_copy import note_entry_names
    from nbdist.worker.torch_modes import note_modes, restore_modes

    if spec.start_method != "fork":  # a forked rank's __main__ is the kernel's: every name is the user's
        note_entry_names()  # what the heal copies and lists: the user's names only, not the entry's
    display.install(send_display)  # display() and plt.show() reach the notebook
    track()  # the user's modules the rank has now, and their files' mtimes: what %autoreload compares with
    threading.Thread(target=answer_signals, args=(running, rank), name="nbdist-signals", daemon=True).start()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the kernel closed the session (or died: the parent watch ends us anyway)
        if message[0] == "close":
            return
        if message[0] == "release":  # a peer is stuck in a collective this rank left: free it
            release_groups()
            continue
        if message[0] == "debug_reply":  # a late answer to a pdb prompt of a cell that ended (the stop won)
            continue
        _, cell_id, cell_dir, cell_options, payload = message
        _let_go_of_values()  # the kernel mapped the last cell's values before it sent this one
        start = _log_offsets()
        stop_point.begin_cell()
        running.enter(cell_id, cell_dir)
        _check_collectives(f"cell{cell_id}" if cell_options.get("check_collectives") else None)
        debugger.install(*_debug_channel(conn, send, rank, cell_id))
        modes = note_modes()  # grad mode, inference mode, autocast: a stop may land where they are restored
        counted = group_counts()  # where a stopped or failed cell began: an export replays it from there
        try:
            kind, body = _run_one(cell_dir, rank, payload, cell_options.get("autoreload"))
        except KeyboardInterrupt:  # a second stop within microseconds of the first
            _IN_USER_CODE = False
            kind, body = "interrupted", None
        except BaseException as exc:  # the payload itself could not be read: the cell failed here
            from nbdist.worker.exceptions import describe_exception

            kind, body = "failed", describe_exception(exc)
        if kind == "interrupted":
            restored, hit = restore_modes(modes), stop_point.take_hit()
            body = {"restored": restored, "stopped_before": hit} if restored or hit else None
        body = attach_reach(body, counted, kind)
        running.leave()
        _check_collectives(None)
        debugger.install(None, None)
        track()  # the modules the cell imported, with their files' mtimes before the user can edit them
        send(("done", rank, cell_id, kind, body, (start, _log_offsets()), take_report()))


def _join_healed_session(address):
    """A rank the heal started (:mod:`nbdist.session.healing`): make the donor's groups in its order,
    while the survivors re-form theirs, then say hello where the heal listens. Else ``address``."""
    heal_file = os.environ.get(HEAL_FILE_ENV)
    if not heal_file:
        return address
    import pickle

    from nbdist.worker import reformable_groups
    from nbdist.worker.group_replay import replay_groups

    with open(heal_file, "rb") as fh:
        heal = pickle.load(fh)
    if _torch_groups_in_use():
        replay_groups(heal["groups"])
        reformable_groups.joined()
    return tuple(heal["address"])


def _debug_channel(conn, send, rank: int, cell_id: int):
    """``(ask, resumed)`` for the cell ``cell_id``'s debugger (:mod:`nbdist.worker.debugger`): ask the
    kernel for a pdb command and wait for it; say that pdb let the code run on."""
    def ask(text: str, where: str) -> str:
        send(("debug", rank, cell_id, text, where))
        while True:
            try:
                conn.poll(None)  # the stop button interrupts this wait (nothing was read yet)
                with _stop_held():  # and never a read half done
                    message = conn.recv()
            except KeyboardInterrupt:
                return "quit"  # the stop button ends debugging: pdb quits, the cell is interrupted
            except (EOFError, OSError):
                return "quit"
            if message[0] == "release":  # a peer stuck in a collective this rank left (as between cells)
                release_groups()
            elif message[0] == "close":  # the session closes: pdb quits; the channel's end follows
                return "quit"
            elif message[0] == "debug_reply" and message[1] == cell_id:
                return message[2]

    def resumed(text: str) -> None:
        send(("debug_resumed", rank, cell_id, text))

    return ask, resumed


def _check_collectives(cell: str | None) -> None:
    """``--check-collectives`` for the cell that starts (None: off again when it ended)."""
    if cell is not None or "nbdist.worker.flight_recorder" in sys.modules:  # no groups: never loaded
        from nbdist.worker.flight_recorder import checking

        checking(cell)


def _let_go_of_values() -> None:
    while _HELD:
        _HELD.pop().close()


def set_shared_names(shared) -> None:
    """Run on ranks by ``Session.push``: the values, mapped from the kernel's shared memory, become
    names of the rank's ``__main__`` (each rank's copy-on-write: its own)."""
    set_names(load_shared(shared))


def set_shared_piece(name: str, shared) -> None:
    """Run on ranks by ``Session.scatter``: this rank's piece of the pieces the kernel shared."""
    pieces = load_shared(shared)
    sys.modules["__main__"].__dict__[name] = pieces[int(os.environ.get("RANK", "0"))]


def set_names(values: dict) -> None:
    """Run on ranks by ``Session.push``: the values become names of the rank's ``__main__``."""
    sys.modules["__main__"].__dict__.update(values)


def count_collectives():
    """Run on ranks after a cell ended abnormally: ``(re-formable, {group: collectives issued},
    models to reset (DDP ones left mid-reduction, FSDP2 roots), DDP models' fingerprints,
    {optimizer: (steps in the cell, stopped inside one)})``, or None without a process group.
    Equal counts on every rank: the groups are still in step."""
    if not _torch_groups_in_use():
        return None
    from nbdist.worker import model_reset as models
    from nbdist.worker import reformable_groups
    from nbdist.worker.optimizer_steps import steps_this_cell

    return (bool(reformable_groups.live_groups()), reformable_groups.count_collectives(),
            models.count_unfinished_ddp() + models.count_fsdp_roots(), models.fingerprint_ddp_models(),
            steps_this_cell())


def reset_models() -> int:
    """Run on every rank alike when a DDP backward or an FSDP2 step may have been stopped half-way
    (see :mod:`nbdist.worker.model_reset`)."""
    from nbdist.worker import model_reset as models

    return sum(models.reset_models().values())


def sync_replicas(src: int) -> dict:
    """Run on every rank by ``Session.sync``: re-sync DDP replicas and their optimizers from ``src``
    (:mod:`nbdist.worker.replica_sync`; imported here, on the rank, so the kernel needs no torch)."""
    from nbdist.worker import replica_sync

    return replica_sync.sync_replicas(src)


def release_groups() -> None:
    """Drop this rank's group connections (see :mod:`nbdist.worker.reformable_groups`)."""
    if _torch_groups_in_use():
        from nbdist.worker import reformable_groups

        reformable_groups.release_groups()


def reform_groups(generation: int, connect_timeout: float | None = None) -> dict:
    """Run on every rank to re-form the groups in place under ``generation`` (each connect within
    ``connect_timeout`` seconds, where given: the heal's)."""
    from nbdist.worker import reformable_groups

    return reformable_groups.reform_groups(generation, connect_timeout)


def degrade_groups(gone: dict, generation: int, connect_timeout: float | None = None) -> dict | None:
    """Run on the survivors of a death: their groups lack the dead ranks until the heal
    (:func:`nbdist.worker.reformable_groups.degrade_groups`); None without a process group."""
    if not _torch_groups_in_use():
        return None
    from nbdist.worker import reformable_groups

    return reformable_groups.degrade_groups(gone, generation, connect_timeout)


def get_name(name: str):
    """Run on ranks by ``Session.pull``: a name of the rank's ``__main__``."""
    main = sys.modules["__main__"].__dict__
    if name not in main:
        raise NameError(f"name {name!r} is not defined on this rank")
    return main[name]
