"""One incarnation of a session: one set of ranks, from their start to their end.

A session's ranks are one long-lived :class:`nbdist.run.state.Run` whose payload is the cell loop
of :mod:`nbdist.worker.session_loop`. Everything a run guarantees holds for them as it is: each
rank in its own process group, death with the kernel, the marker that ``nbdist.ps()`` finds,
complete log files. A rank that *dies* takes the whole tree down under an engine (the incarnation
is then "broken"); ranks nbdist started itself keep the survivors (degraded, then healed).

Everything that belongs to those ranks lives here and nowhere else: their connections and pids,
the cell that runs, its timer, the threads that read replies and bring the ranks in step, the
link to other kernels. :meth:`nbdist.Session.restart` makes a new incarnation; the old one is
ended, and whatever of it still runs (a late timer, a recovery thread, its reply reader) acts on
its own ended state only, never on the new ranks.

Two levels, and every step knows which it is in:

* *cell* level (each cell a :class:`~nbdist.session.cell_handle.CellHandle`): a cell finishes,
  fails or is interrupted; the ranks go back to idle with their namespaces kept. A rank left in a
  collective is released, and every rank's process groups are then re-formed in place
  (:mod:`nbdist.worker.reformable_groups`, :mod:`nbdist.session.recovery`) before the cell says
  it is done.
* *incarnation* level: a rank that can't be brought back from C code within a few seconds ends the
  incarnation and its whole tree; its state is lost and the next cell says so. A rank that *dies*
  does so too under an engine (torchrun, mpirun, srun end the survivors themselves); ranks nbdist
  started itself keep their state, and the incarnation is degraded (:mod:`nbdist.session.rank_deaths`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import threading
import time

from nbdist.errors import LaunchConfigError, SessionLostError, format_rank_set
from nbdist.options import WorldOptions
from nbdist.protocol import rundir
from nbdist.protocol.session_channel import INLINE_PAYLOAD_MAX, SESSION_KEY_FILE
from nbdist.run.events import TERMINAL, OutputChunk, RunEvent
from nbdist.session.bring_up import bring_up
from nbdist.session.lifecycle import Life
from nbdist.session.cell_handle import CellHandle
from nbdist.session.peers import tell_world_gone
from nbdist.session.reply_reader import ReaderWake, read_replies
from nbdist.session.cell_history import CellHistory
from nbdist.session.rank_deaths import dead_targets, describe_gone, note_rank_death, refuse_for_gone, tell_untold_deaths
from nbdist.run.rank_listener import RankListener
from nbdist.session.watched_files import WatchedFiles
from nbdist.session.internal_calls import CHECK_TIMEOUT_S
from nbdist.session.recovery import (RELEASE_AFTER_PEER_FAILED_S, RELEASE_AFTER_S, catch_up, interrupt_ranks, recover,
                                     stop_cell)

__all__ = ["Incarnation", "default_start_timeout"]

def default_start_timeout(nprocs: int) -> float:
    """How long ranks may take to come up: spawned ones import torch, all of them on a busy box."""
    return max(120.0, 4.0 * nprocs)


class Incarnation:
    """The ranks of a session from their start to their end, and everything that acts on them.

    Made by :class:`nbdist.Session`; users hold the session, which always points at its current
    incarnation. The constructor returns at once; the ranks come up on a thread.

    Attributes
    ----------
    status : str
        "starting", "idle", "busy", "broken" or "closed"; the last two are final. The state machine
        behind it (recovering, degraded, healing too) is ``life`` (:mod:`nbdist.session.lifecycle`).
    session_id, run_dir : str
        The marker of every process of this incarnation, and its record (logs, cells).
    """

    def __init__(self, options: WorldOptions, number: int, restart_hint: str, start_timeout: float | None = None):
        from nbdist.launchers import choose_master_addr

        engine = options.make_engine()
        self.options, self.number, self.restart_hint = options, number, restart_hint
        self.lost_reason = None
        self.lock = threading.RLock()
        self.life = Life(self.lock)  # its state and the groups' generation: every move is made there
        self.conns: dict[int, object] = {}
        self.pids: dict[int, int] = {}
        self.remote: set[int] = set()  # ranks on other machines (srun, mpirun with hosts): never signalled
        self.watched_files = WatchedFiles()  # the ranks' module files, for %autoreload
        self.active: CellHandle | None = None
        self.recovering: CellHandle | None = None  # a user cell whose ranks are being brought in step
        self.send_lock = threading.Lock()
        self.reader_wake = ReaderWake()  # the reply reader takes a healed rank's connection in
        self.reform_due = -1  # the generation another node's kernel re-forms from (nbdist.session.peers)
        self.stopped_by: str | None = None  # that kernel's reason
        self.told = threading.Condition(self.lock)  # notified when another kernel says it stopped
        self.in_step = threading.Event()  # cleared while this node re-forms with the others
        self.in_step.set()
        self.world = None  # a session across kernels: its link to the others (nbdist.session.peers)
        self.last_reform: dict | None = None  # each rank's timings of the last re-forming
        self.reforming: tuple | None = None  # (generation, the ranks it needs): a death among them calls it off
        self.history = CellHistory()  # the user's cells, for the export
        self.defined_names: set[str] = set()  # names earlier cells defined on the ranks (the magic's rule)
        self.sources_held: set[str] = set()  # notebook cell sources every rank got with an earlier cell
        self.last_failed_rank: int | None = None  # the root cause of the last failed cell (%dist_debug)
        self.gone: dict = {}  # rank -> RankGone: ranks that died, the survivors kept (nbdist.session.rank_deaths)
        self.gone_told: set[int] = set()  # of those, the ones the survivors' groups know they lack
        # rank -> RankFailure: the heal's replacements that died during it (between two of its calls,
        # none of which then waits on them: the next one must not either)
        self.replacements_dead: dict = {}
        self.heal_mode: str | None = None  # "auto": a death is healed at once (Session(heal="auto"))
        self.last_heal = None  # the last heal's HealReport, or the error that stopped it
        self._cells = 0
        self.ready = threading.Event()
        self.started_at, self.ready_after = time.monotonic(), None
        self.nprocs = options.resolved_nprocs()
        self.start_timeout = start_timeout or default_start_timeout(self.nprocs)
        self.session_id = rundir.new_run_id()
        self.run_dir = rundir.create_run_dir(self.session_id, options.run_dir)
        try:
            key = secrets.token_bytes(32)
            rundir.write_private(os.path.join(self.run_dir, SESSION_KEY_FILE), key)
            # torchrun's agent starts this node's ranks here (other nodes' kernels have their own): they reach
            # this kernel on loopback. master_addr is node 0's address, which no other node can bind.
            host = "127.0.0.1" if engine is not None and not engine.remote_ranks else \
                choose_master_addr(engine, options.master_addr)
            self.listener = RankListener(host, key, self.nprocs)
        except BaseException:
            rundir.discard_run_dir(self.run_dir)
            raise
        self.address = self.listener.address  # where the ranks connected (nothing listens once all are in)
        self.rank_run = None
        self.engine = engine  # torchrun's, for a world across kernels: its store is where they agree
        self.launched = threading.Event()
        # Starting processes takes a while with spawn: the constructor returns at once, and a cell
        # sent meanwhile waits for the ranks.
        threading.Thread(target=bring_up, args=(self, engine), name=f"nbdist-session-{self.session_id}",
                         daemon=True).start()

    def __repr__(self) -> str:
        gone = f" ({describe_gone(self.gone)})" if self.gone else ""
        return f"<nbdist session incarnation {self.number} {self.session_id} {self.status}{gone}>"

    @property
    def from_magics(self) -> bool:
        """The notebook's magics made the session (their restart hint names %dist_restart): messages
        name the magics, else the API."""
        return self.restart_hint.startswith("%")

    @property
    def heal_hint(self) -> str:
        """What brings dead ranks back, in the words of the front end that made the session."""
        return f"{'%dist_heal' if self.from_magics else 'Session.heal()'} brings dead ranks back from their peers"

    @property
    def status(self) -> str:
        """As ``Session.status`` says it: "starting", "idle", "busy", "broken" or "closed"."""
        return self.life.public

    @property
    def generation(self) -> int:
        return self.life.generation

    @property
    def ended(self) -> bool:
        return self.life.ended

    # ---- replies -----------------------------------------------------------------------------
    def read_replies(self) -> None:
        """The ranks' answers, for as long as the incarnation lives (:mod:`nbdist.session.reply_reader`)."""
        read_replies(self)

    def add_rank(self, hello) -> None:
        """A rank the heal started said hello: from now on it is one of the ranks, read and written."""
        with self.lock:
            self.conns[hello.rank], self.pids[hello.rank] = hello.conn, hello.pid
        self.reader_wake.wake()

    def remove_rank(self, rank: int) -> None:
        """A rank the heal started, and stopped again: it is not one of the ranks (it stays gone)."""
        with self.lock:
            self.pids.pop(rank, None)
            conn = self.conns.pop(rank, None)
        if conn is not None:
            conn.close()

    def heal(self, donor: int | None = None):
        """Bring the dead ranks back from their peers (:func:`nbdist.session.healing.heal`)."""
        from nbdist.session.healing import heal

        return heal(self, donor)

    def settle(self, cell: CellHandle) -> None:
        """Every rank of ``cell`` answered (or died): end it, bringing the ranks in step first if needed."""
        # The cell's output is in the logs before the cell says it is done (each rank said how far).
        self.rank_run.pump_output(unless_read_to={r: ends for r, (_, ends) in cell.offsets.items()})
        if cell.internal:
            cell.finish()
            return
        untold = set(self.gone) - self.gone_told  # a rank died meanwhile: the survivors' groups must know
        if cell.failures or cell.interrupted or untold or self.reform_due == self.generation:
            with self.lock:
                if not self.life.move("recovering", only_from=("busy",)):
                    return  # lost or closed meanwhile: whoever ended it ended the cell too
                self.recovering = cell
            # Not on this thread: it reads the ranks' replies, which bringing them in step needs.
            threading.Thread(target=recover, args=(self, cell), daemon=True).start()
            return
        self.become_idle(cell)

    def become_idle(self, cell: CellHandle) -> None:
        """The cell is over and the ranks are in step: idle, then the cell says it is done."""
        with self.lock:  # idle before the cell says it is done: the caller's next cell must find it so
            self.life.move("degraded" if self.gone else "idle", only_from=("busy", "recovering"))
            self.recovering = None
        cell.finish()
        tell_untold_deaths(self)  # one that died while they were brought in step

    def on_run_event(self, event) -> None:
        """The ranks' run ended by itself (a rank died, and the run took the whole tree down)."""
        if isinstance(event, OutputChunk):
            cell = self.active
            if cell is not None:
                cell.feed(event)  # each rank's log stays one file; the cell shows its own part of it
            return
        if not isinstance(event, RunEvent) or event.status not in TERMINAL:
            return
        if event.rank is not None:
            if self.rank_run.keep_survivors:  # a rank of ours died: the survivors keep their state
                note_rank_death(self, event.rank, event.detail)
            else:  # the run stops the tree next
                tell_world_gone(self, f"was lost ({format_rank_set(self.rank_run.first_gone() or [event.rank])} ended)")
            return
        error = self.rank_run.error
        with self.lock:
            if self.life.state == "closed":
                return
            if self.lost_reason is None:
                why = error.summary() if hasattr(error, "summary") else f"its ranks ended ({event.status})"
                if self.gone and not self.pids:  # the survivors of earlier deaths died too
                    why = f"every rank died: {describe_gone(self.gone)}"
                self.lost_reason = f"the session was lost: {why}; its state is gone; {self.restart_hint}"
            self.life.end("lost")
        self.ready.set()
        self.listener.close()
        for cell in (self.active, self.recovering):
            if cell is not None:
                cell.lose(SessionLostError(self.lost_reason, error))

    def lose(self, reason: str) -> None:
        """End this incarnation, whole tree, because its ranks can't go on; ``reason`` is what every
        later cell says."""
        with self.lock:
            if self.ended:
                return
            self.lost_reason = reason
        tell_world_gone(self, "was stopped (a rank could not be brought back; its kernel says which)")
        self.launched.wait(60)
        if self.rank_run is not None:
            self.rank_run.kill()  # -> on_run_event: broken, the active cell lost
        else:
            self.life.end("lost")
            self.ready.set()

    def close(self, timeout: float = 5.0) -> None:
        """End the ranks: they leave their loop (atexit handlers run), then the tree is stopped."""
        with self.lock:
            was = self.status
            if not self.life.end("closed"):
                return
        self.ready.set()
        self.listener.close()
        if self.world is not None:  # before the tree goes: node 0's agent hosts the store
            self.world.close()
        self.launched.wait(60)
        if self.rank_run is None:  # it never started
            return
        if was in ("idle", "busy", "degraded"):  # they leave their loop: their atexit handlers run
            for conn in list(self.conns.values()):
                with contextlib.suppress(OSError), self.send_lock:
                    conn.send(("close",))
            if was == "busy" and self.active is not None:  # the cell is interrupted first; then "close"
                busy = self.active.busy_ranks()  # still ours: the tree is stopped only below
                interrupt_ranks(self.active, [self.pids[r] for r in busy if r in self.pids and r not in self.remote])
            with contextlib.suppress(Exception):
                self.rank_run.wait(timeout)
        if not self.rank_run.done:
            self.rank_run.kill()
        for conn in list(self.conns.values()):
            conn.close()
        for cell in (self.active, self.recovering):
            if cell is not None:
                cell.lose(SessionLostError("the session was closed"))

    def catch_up(self) -> None:
        """Idle, re-form the world's groups with another node's kernel that stopped a cell."""
        catch_up(self)

    # ---- state -------------------------------------------------------------------------------
    def local_pids(self, ranks) -> list[int]:
        """The pids of ``ranks`` that run on this machine, while this incarnation lives: the ones a
        signal may reach (an ended incarnation's pids may belong to someone else by now)."""
        if self.ended:
            return []
        return [self.pids[r] for r in ranks if r in self.pids and r not in self.remote]

    def ranks_elsewhere(self) -> list[int]:
        """Ranks of the world that other kernels drive (a session across nodes, torchrun --nnodes)."""
        if self.options.nnodes == 1:
            return []
        return sorted(set(range(self.nprocs * self.options.nnodes)) - set(self.pids))

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every rank is up (True; False on ``timeout``); raise SessionLostError if it can't serve."""
        if not self.ready.wait(timeout):
            return False
        if self.status == "broken":
            raise SessionLostError(self.lost_reason)
        if self.status == "closed":
            raise SessionLostError(f"the session was closed; {self.restart_hint}")
        return True

    # ---- cells -------------------------------------------------------------------------------
    def prepare(self, ranks=None) -> list[int]:
        """Wait until the ranks can take a cell; return the ranks it will run on.

        Raises SessionLostError when they can't (lost, closed), RuntimeError while a cell runs.
        """
        self.wait_ready(self.start_timeout + 10)  # a cell sent while the ranks start waits for them
        if self.status == "starting":
            raise SessionLostError(f"the session's ranks did not come up within {self.start_timeout:g} s")
        self.in_step.wait(CHECK_TIMEOUT_S + 10)  # and one sent while it re-forms with other nodes
        self._wait_for_heal()
        targets = self._targets(ranks)
        if self.status == "busy":
            raise RuntimeError(f"cell {self.active.cell_id} is still running in this session; "
                               "wait for it or interrupt it")
        if self.ended:
            self.wait_ready(0)  # says why
        return targets

    def _wait_for_heal(self) -> None:
        """A cell sent while the session heals waits for the heal (which has deadlines of its own)."""
        from nbdist.session.healing import HEAL_CONNECT_S

        deadline = time.monotonic() + 2 * HEAL_CONNECT_S + 60
        while self.life.state == "healing" and time.monotonic() < deadline:
            time.sleep(0.05)

    def _targets(self, ranks) -> list[int]:
        """The ranks a cell for ``ranks`` runs on; a dead one is refused in one line (RankGoneError)."""
        targets = sorted(set(self.conns) | set(self.gone)) if ranks is None else sorted(set(ranks))
        refuse_for_gone(self, targets)
        unknown = [r for r in targets if r not in self.conns]
        if unknown or not targets:
            raise LaunchConfigError(f"ranks must be a subset of {format_rank_set(self.conns)}, got {ranks!r}")
        return targets

    def note_sources_sent(self, targets, sent) -> None:
        """A cell's payload carried the notebook sources ``sent`` to ``targets``: once every rank
        holds them, later cells leave them out (``rundir.write_payload(sources_held=...)``)."""
        if sent and set(targets) >= set(self.conns):
            self.sources_held |= sent

    @property
    def cells_sent(self) -> int:
        """The number of the last cell dir made (user cells and nbdist's own calls alike)."""
        return self._cells

    def new_cell_dir(self) -> str:
        """A private folder for the next cell's record (its payload, its source)."""
        with self.lock:
            self._cells += 1
            cell_dir = os.path.join(self.run_dir, "cells", f"{self._cells:04d}")
        os.makedirs(cell_dir, mode=0o700)
        return cell_dir

    def start_cell(self, cell_dir: str, targets: list[int], payload: bytes, timeout=None, internal: bool = False,
                   check_collectives: bool = False, stdin: bool = False, autoreload=None) -> CellHandle:
        """Send the cell's ``payload`` (:func:`nbdist.protocol.rundir.pack_payload`) to ``targets``;
        return the cell's handle at once. A small payload goes with the message (no file to write
        and read back on the way of every cell); a big one (a function's tensor argument, say) is
        written once into ``cell_dir`` for every rank to read.

        ``internal``: nbdist's own call while it brings the ranks in step after a user's cell;
        ``check_collectives``: the ranks compare each collective before they issue it; ``stdin``: a
        front end answers the ranks' pdb prompts (:mod:`nbdist.frontend.debugger_prompt`);
        ``autoreload``: an :class:`~nbdist.protocol.session_channel.Autoreload`: each rank first reloads
        the modules of the user's that changed on disk (:mod:`nbdist.worker.autoreload`).
        """
        if len(payload) > INLINE_PAYLOAD_MAX:
            rundir.write_private(os.path.join(cell_dir, rundir.PAYLOAD_FILE), payload)
            payload = None
        with self.lock:
            # nbdist's own cells run while the ranks are brought in step; a user's, when they are idle.
            if self.life.state not in (("recovering", "healing") if internal else ("idle", "degraded")):
                raise RuntimeError(f"the session is {self.status}; it can't take a cell now")
            cell = self.active = CellHandle(self, int(os.path.basename(cell_dir)), targets, cell_dir, internal, stdin)
            if not internal:
                self.life.move("busy")
            dead = dead_targets(self, targets) if internal else {}
        if dead:  # the call fails on them at once, as on a rank that dies during it
            targets = [r for r in targets if r not in dead]
            if any([cell.record_death(failure) for failure in dead.values()]):
                threading.Thread(target=self.settle, args=(cell,), daemon=True).start()
        if timeout is not None:
            cell.start_timer(timeout, self.interrupt_cell)
        if autoreload is not None and not internal and not self.remote.intersection(targets):
            # Ranks on this machine see the kernel's files: it stats each once for all of them.
            autoreload = dataclasses.replace(autoreload, changed=self.watched_files.changed())
        options = {"check_collectives": bool(check_collectives), "autoreload": None if internal else autoreload}
        self.rank_run.pace.wake()  # the cell's first lines show live, not a quiet tick late
        self.send(targets, ("cell", cell.cell_id, cell_dir, options, payload))
        return cell

    def send(self, ranks, message) -> None:
        """Write ``message`` to each of ``ranks`` (small tuples: one write each, never torn)."""
        with self.send_lock:  # the stop button's thread and the cell's may both write
            for rank in ranks:
                self.conns[rank].send(message)

    def interrupt_cell(self, cell: CellHandle, release_after: float = RELEASE_AFTER_S) -> None:
        """SIGINT to every busy rank; release a rank left in a collective; a stuck one ends the
        incarnation (:func:`nbdist.session.recovery.stop_cell`). Nothing, once it has ended."""
        if cell.incarnation is not self or self.ended:
            return
        stop_cell(self, cell, release_after)

    def release_peers_of(self, cell: CellHandle) -> None:
        """A rank of ``cell`` raised or died: its peers may wait for it in a collective. On a thread:
        stop them as the stop button would, sooner (the error must show within about 2 s)."""
        threading.Thread(target=self.interrupt_cell, args=(cell, RELEASE_AFTER_PEER_FAILED_S), daemon=True).start()

    def dump_stacks(self, ranks) -> str:
        """Each stuck rank's stack into its log (as a timeout does); where the first one stood."""
        dumps = self.stacks(ranks, timeout=0.5)
        first = dumps.get(ranks[0])
        return f", {first.where}; stacks in the rank logs" if first is not None else ""

    def stacks(self, ranks=None, timeout: float = 2.0) -> dict:
        """Every local rank's Python stack, now, without stopping anything: ``{rank: StackDump}``."""
        from nbdist.run.stacks import dump_stacks

        ranks = sorted(self.pids) if ranks is None else ranks
        pids = dict(zip([r for r in ranks if r in self.pids and r not in self.remote], self.local_pids(ranks)))
        return dump_stacks({r: (pid, rundir.log_path(self.run_dir, r, "stderr")) for r, pid in pids.items()}, timeout)
