"""Sessions: ranks that live across cells, keep their namespace and process group, take a cell in milliseconds.

A session's ranks are one long-lived :class:`nbdist.run.state.Run` whose payload is the cell loop of
:mod:`nbdist.worker.session_loop`. Everything a run guarantees holds for them as it is: each rank in its
own process group, death with the kernel, the marker that ``nbdist.ps()`` finds, complete log
files, and a rank that *dies* takes the whole tree down (the session is then "broken").

Two levels, and every step knows which it is in:

* *cell* level (:mod:`nbdist.session.cells`, each cell a :mod:`nbdist.session.cell_handle` handle): a
  cell finishes, fails or is interrupted; the ranks go back to idle with their namespaces kept.
  A rank left in a collective is released (its free peers drop their connections, or it cuts its
  own), and every rank's process groups are then re-formed in place (:mod:`nbdist.worker.reformable_groups`,
  :mod:`nbdist.session.recovery`) before the cell says it is done.
* *session* level: a rank that died, or can't be brought back from C code within a few seconds,
  ends the session and its whole tree; its state is lost and the next cell says so.

A world across nodes (torchrun --nnodes) has a session per kernel; the kernels stop, re-form and
go down together, agreeing through the world's store (:mod:`nbdist.session.peers`).

The channel that carries cells is code execution: ``multiprocessing.connection`` with a
per-session key (a 0600 file in the 0700 run dir), listening on loopback unless the world
options ask for another address.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import signal
import socket
import threading
import time
import weakref
from multiprocessing.connection import Listener, wait

from nbdist.protocol import rundir
from nbdist.errors import LaunchConfigError, SessionLostError
from nbdist.options import WorldOptions
from nbdist.session.recovery import RELEASE_AFTER_PEER_FAILED_S, catch_up, recover, release_if_asked
from nbdist.session.cell_handle import CellHandle
from nbdist.session.cells import CellLevel
from nbdist.protocol.session_channel import SESSION_KEY_FILE, set_nodelay
from nbdist.worker.session_loop import serve_session
from nbdist.run.events import OutputChunk
from nbdist.session.peers import link_kernels, tell_world_gone

__all__ = ["Session"]


_LIVE: weakref.WeakSet = weakref.WeakSet()


class Session(CellLevel):
    """Ranks that stay alive between cells, each with its namespace and its process group.

    Parameters are :func:`nbdist.launch`'s world options. The ranks start in the background
    (forked from the warm template when it is ready); the constructor returns at once.

    Attributes
    ----------
    status : str
        "starting", "idle", "busy", "broken" or "closed".
    session_id, run_dir : str
        The marker of every process of the session, and its record (logs, cells).

    Examples
    --------
    >>> s = nbdist.Session(nprocs=4)
    >>> s.execute("import torch, torch.distributed as dist\\nmodel = torch.nn.Linear(4, 1)")
    >>> s.run(lambda: dist.get_rank())
    {0: 0, 1: 1, 2: 2, 3: 3}
    >>> s.execute("model.weight.shape")     # the model is still there
    >>> s.close()
    """

    def __init__(self, nprocs=None, launcher="auto", backend="auto", env=None, run_dir=None, launcher_args=None,
                 nnodes=1, node_rank=0, master_addr=None, master_port=None, start_method=None):
        self.options = WorldOptions(nprocs=nprocs, launcher=launcher, backend=backend, env=env, run_dir=run_dir,
                                    launcher_args=launcher_args, nnodes=nnodes, node_rank=node_rank,
                                    master_addr=master_addr, master_port=master_port,
                                    start_method=start_method).check()
        if launcher == "attach":
            raise LaunchConfigError("an attached kernel already is a persistent rank: run cells in it directly")
        self._lock = threading.RLock()
        self._start()
        _LIVE.add(self)

    # ---- session level: start, lose, close -------------------------------------------------
    def _start(self) -> None:
        from nbdist.launchers import choose_master_addr

        engine = self.options.make_engine()
        self.status, self.lost_reason = "starting", None
        self._conns: dict[int, object] = {}
        self._pids: dict[int, int] = {}
        self._remote: set[int] = set()  # ranks on other machines (srun, mpirun with hosts)
        self._active: CellHandle | None = None
        self._recovering: CellHandle | None = None  # a user cell whose ranks are being brought in step
        self._send_lock = threading.Lock()
        self._generation = 0  # of the ranks' process groups, one more per re-forming
        self._reform_due = -1  # the generation another node's kernel re-forms from (nbdist.session.peers)
        self._stopped_by: str | None = None  # that kernel's reason
        self._told = threading.Condition(self._lock)  # notified when another kernel says it stopped
        self._in_step = threading.Event()  # cleared while this node re-forms with the others
        self._in_step.set()
        self.world = None  # a session across kernels: its link to the others (nbdist.session.peers)
        self.last_reform: dict | None = None  # each rank's timings of the last re-forming (nbdist.session.recovery)
        self._cells = 0
        self.defined_names: set[str] = set()  # names earlier cells defined on the ranks (the magic's rule)
        self._ready = threading.Event()
        self._started_at, self.ready_after = time.monotonic(), None
        self.session_id = rundir.new_run_id()
        self.run_dir = rundir.create_run_dir(self.session_id, self.options.run_dir)
        key = secrets.token_bytes(32)
        rundir.write_private(os.path.join(self.run_dir, SESSION_KEY_FILE), key)
        self._listener = Listener((choose_master_addr(engine, self.options.master_addr), 0), authkey=key)
        self.address = self._listener.address  # where the ranks connected (nothing listens once all are in)
        self.nprocs = self.options.resolved_nprocs()
        self.rank_run = None
        self._launched = threading.Event()
        # Starting processes takes a while with spawn (each child must read its bootstrap): the
        # constructor returns at once, and a cell sent meanwhile waits for the ranks.
        threading.Thread(target=self._bring_up, args=(engine,), name=f"nbdist-session-{self.session_id}",
                         daemon=True).start()

    def _bring_up(self, engine) -> None:
        from nbdist.run.start import start_run

        if self.options.nnodes > 1:  # the link to the other kernels needs torch here: import it meanwhile
            threading.Thread(target=__import__, args=("torch.distributed",), daemon=True).start()
        try:
            self.rank_run = start_run(serve_session, (self.run_dir, self.address), {}, self.options,
                                      launcher=engine, run_id=self.session_id, run_dir=self.run_dir,
                                      reformable=True)
        except BaseException as exc:  # start-or-close already stopped what it started
            with self._lock:
                self.lost_reason = f"the session could not start: {type(exc).__name__}: {exc}"
                if self.status != "closed":
                    self.status = "broken"
            self._listener.close()
            self._ready.set()
            return
        finally:
            self._launched.set()
        self.rank_run.subscribe(self._on_run_event)  # replayed: a run that ended already is seen too
        self._accept_ranks(engine)

    def _accept_ranks(self, engine) -> None:
        """Take each rank's hello (a client with the wrong key is refused and ignored), then read their replies."""
        while len(self._conns) < self.nprocs and self.status == "starting":
            try:
                conn = self._listener.accept()
                _, rank, pid, host = conn.recv()
            except Exception:  # an authentication failure, a client that went away, or our own close
                if self.status != "starting":
                    return
                continue
            set_nodelay(conn)
            self._conns[rank], self._pids[rank] = conn, pid
            if host != socket.gethostname():  # a pid of another machine: never one to signal here
                self._remote.add(rank)
        self._listener.close()  # nothing more may connect
        with self._lock:
            if self.status == "starting":
                self.status = "idle"
                self.ready_after = time.monotonic() - self._started_at
                if self.options.nnodes > 1:  # only now: the world formed, the store there is this world's
                    self.world = link_kernels(self, engine)
        self._ready.set()
        self._read_replies()

    def _wake_listener(self) -> None:
        """Unblock a pending accept(): closing the socket alone does not wake it on Linux."""
        import socket

        sock = getattr(getattr(self._listener, "_listener", None), "_socket", None)
        with contextlib.suppress(OSError):
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _read_replies(self) -> None:
        """The ranks' answers; no polling: blocks until one writes or goes away."""
        conns = {id(c): r for r, c in self._conns.items()}
        live = list(self._conns.values())
        while live and self.status not in ("broken", "closed"):
            for conn in wait(live):
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    live.remove(conn)  # that rank exited: the session run's monitor says why
                    self.rank_run.saw_rank_go(conns[id(conn)])
                    # Its socket closed first: the other nodes hear it now.
                    tell_world_gone(self, f"was lost (rank {conns[id(conn)]} ended)")
                    continue
                self._on_reply(conns[id(conn)], message)

    def _on_reply(self, rank: int, message) -> None:
        cell = self._active
        if cell is None or message[2] != cell.cell_id:
            return
        if message[0] == "started":
            cell.record_start(rank, message[3])
            return
        if message[0] == "display":
            cell.feed_display(rank, message[3], message[4])
            return
        _, _, _, kind, body, offsets = message
        last = cell.record_done(rank, kind, body, offsets, self._pids.get(rank))
        release_if_asked(self, cell, rank)
        if last:
            self._settle(cell)
        elif kind == "failed" and not cell.internal:
            # Its peers may wait for it in a collective: release them as the stop button would.
            threading.Thread(target=self.interrupt_cell, args=(cell, RELEASE_AFTER_PEER_FAILED_S),
                             daemon=True).start()

    def _settle(self, cell: CellHandle) -> None:
        self.rank_run._pump_output()  # the cell's output is in the logs before the cell says it is done
        if cell.internal:
            cell.finish()
            return
        if cell.failures or cell.interrupted or self._reform_due == self._generation:
            with self._lock:
                self._recovering = cell
            # Not on this thread: it reads the ranks' replies, which bringing them in step needs.
            threading.Thread(target=recover, args=(self, cell), daemon=True).start()
            return
        self.become_idle(cell)

    def become_idle(self, cell: CellHandle) -> None:
        """The cell is over and the ranks are in step: idle, then the cell says it is done."""
        with self._lock:  # idle before the cell says it is done: the caller's next cell must find it so
            if self.status == "busy":
                self.status = "idle"
            self._recovering = None
        cell.finish()

    def _on_run_event(self, event) -> None:
        """The session run ended by itself: a rank died, and the run took the whole tree down."""
        from nbdist.run.events import TERMINAL, RunEvent

        if isinstance(event, OutputChunk):
            cell = self._active
            if cell is not None:
                cell.feed(event)  # each rank's log stays one file; the cell shows its own part of it
            return
        if not isinstance(event, RunEvent) or event.status not in TERMINAL:
            return
        if event.rank is not None:  # a rank ended: the run stops the tree next
            tell_world_gone(self, f"was lost (rank {event.rank} ended)")
            return
        with self._lock:
            if self.status == "closed":
                return
            if self.lost_reason is None:
                error = self.rank_run.error
                why = error.summary() if hasattr(error, "summary") else f"its ranks ended ({event.status})"
                self.lost_reason = f"the session was lost: {why}; its state is gone; restart() brings new ranks"
            self.status = "broken"
        self._ready.set()
        self._wake_listener()
        for cell in (self._active, self._recovering):
            if cell is not None:
                cell.lose(SessionLostError(self.lost_reason, self.rank_run.error))

    def _lose(self, reason: str) -> None:
        """Stop the session, whole tree, because a rank can't be brought back."""
        with self._lock:
            self.lost_reason = reason
        tell_world_gone(self, "was stopped (a rank could not be brought back; its kernel says which)")
        self.rank_run.kill()  # -> _on_run_event: broken, the active cell lost

    def close(self, timeout: float = 5.0) -> None:
        """End the session: ranks leave their loop (atexit handlers run), then the tree is stopped."""
        with self._lock:
            if self.status == "closed":
                return
            was = self.status
            self.status = "closed"
        self._ready.set()
        self._wake_listener()
        if self.world is not None:  # before the tree goes: node 0's agent hosts the store
            self.world.close()
        self._launched.wait()
        if self.rank_run is None:  # it never started
            _LIVE.discard(self)
            return
        if was in ("idle", "busy"):
            for conn in list(self._conns.values()):
                with contextlib.suppress(OSError), self._send_lock:
                    conn.send(("close",))
            if was == "busy":  # the cell is interrupted first; the ranks then read "close"
                for pid in self.local_pids(self._active.busy_ranks()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGINT)
            with contextlib.suppress(Exception):
                self.rank_run.wait(timeout)
        if not self.rank_run.done:
            self.rank_run.kill()
        for conn in list(self._conns.values()):
            conn.close()
        for cell in (self._active, self._recovering):
            if cell is not None:
                cell.lose(SessionLostError("the session was closed"))
        _LIVE.discard(self)

    def catch_up(self) -> None:
        """Idle, re-form the world's groups with another node's kernel that stopped a cell."""
        catch_up(self)

    def restart(self) -> None:
        """Close the session (or what is left of it) and start new ranks with the same options."""
        self.close()
        self._start()
        _LIVE.add(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self) -> str:
        return f"<nbdist.Session {self.session_id} {self.status} nprocs={self.nprocs}>"

    # ---- state -------------------------------------------------------------------------------
    @property
    def pids(self) -> dict[int, int]:
        """rank -> pid of each rank that said hello."""
        return dict(sorted(self._pids.items()))

    def local_pids(self, ranks) -> list[int]:
        """The pids of ``ranks`` that run on this machine: the ones a signal may reach."""
        return [self._pids[r] for r in ranks if r in self._pids and r not in self._remote]

    def ranks_elsewhere(self) -> list[int]:
        """Ranks of the world that other kernels drive (a session across nodes, torchrun --nnodes)."""
        if self.options.nnodes == 1:
            return []
        return sorted(set(range(self.nprocs * self.options.nnodes)) - set(self._pids))

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every rank is up (True; False on ``timeout``); raise SessionLostError if it can't serve."""
        if not self._ready.wait(timeout):
            return False
        if self.status == "broken":
            raise SessionLostError(self.lost_reason)
        if self.status == "closed":
            raise SessionLostError("the session was closed; restart() starts it again")
        return True

@atexit.register
def _close_live_sessions() -> None:
    for session in list(_LIVE):
        with contextlib.suppress(Exception):
            session.close(timeout=2.0)
