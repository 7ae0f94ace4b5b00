"""Run: one execution of one function on all its ranks, from start to nothing left.

:func:`nbdist.run.start.start_run` makes a Run (start-or-close). A Run is the run's state and what
users call; the rest of its life is in modules of its own, each over the same Run:

* :mod:`nbdist.run.monitor`: one thread per run follows the ranks' logs, reaps ranks as they
  exit, stops the rest when one fails (fail-fast), and enforces the timeout;
* :mod:`nbdist.run.ending`: every stop, whoever asks for it, climbs one ladder (SIGINT, SIGTERM,
  SIGKILL) against one deadline (:mod:`nbdist.run.teardown`), and the run ends only when no rank,
  no child of a rank and no marked process is left; then it reads what the ranks left;
* :mod:`nbdist.run.failure_report`: what each rank that failed said, and the root cause.

No IPython and no signal handlers here: the front ends translate their interrupts into
:meth:`Run.interrupt`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref

from nbdist.errors import WorkerFailedError, describe_exitcode
from nbdist.protocol import rundir
from nbdist.protocol.rundir import RunSpec
from nbdist.run import ending
from nbdist.run.at_exit import close_at_exit
from nbdist.run.ending import INTERRUPT_LADDER, KILL_LADDER
from nbdist.run.events import EXITS_TIED_S, TERMINAL, EventSource, RankStatus, RunEvent
from nbdist.run.output import RankOutput
from nbdist.run.teardown import StopReport

__all__ = ["Run", "KILL_LADDER", "INTERRUPT_LADDER", "live_runs"]

_LIVE_RUNS: weakref.WeakSet = weakref.WeakSet()


def live_runs() -> list:
    """The runs of this kernel that have not ended."""
    return [run for run in list(_LIVE_RUNS) if not run.done]


class Run(EventSource):
    """A run of a function on N ranks. Made by :func:`nbdist.launch` with ``join=False``.

    Attributes
    ----------
    run_id : str
        The marker every process of the run carries as ``NBDIST_RUN_ID``.
    run_dir : str
        The private folder with the payload, the per-rank logs, results and errors.
    nprocs : int
        The number of ranks this kernel started.
    status : str
        "starting", "running", "finished", "failed", "interrupted" or "killed".

    Examples
    --------
    >>> run = nbdist.launch(train, nprocs=4, join=False)
    >>> run.status
    'running'
    >>> run.wait()          # {0: ..., 1: ..., 2: ..., 3: ...}
    >>> with nbdist.launch(train, nprocs=4, join=False) as run:
    ...     pass            # leaving the block stops the run
    """

    # A one-shot run says how it ended (time, logs); a session cell that finished says nothing more.
    quiet_when_finished = False

    def __init__(self, run_id, run_dir, spec: RunSpec, launcher, rendezvous=None, timeout=None, stop_timeout=5.0,
                 channel=None):
        self.run_id = run_id
        self.run_dir = run_dir
        self.spec = spec
        self.nprocs = spec.nprocs
        self.timeout = timeout
        self.stop_timeout = stop_timeout
        self.launcher = launcher
        self.rendezvous = rendezvous
        self.channel = channel  # live output of ranks on other machines (engine launchers)
        self.ranks = {r: RankStatus(r) for r in range(spec.nprocs)}
        self.outputs = {r: RankOutput(run_dir, spec.identity_for(r).rank) for r in range(spec.nprocs)}
        self.error: WorkerFailedError | None = None
        self.report: StopReport | None = None
        self.started = time.monotonic()
        self.ended: float | None = None
        self._status = "starting"
        self._results: dict[int, object] = {}
        self._subscribers = []
        self._done = threading.Event()
        self._pump_lock = threading.Lock()
        self._pumped_final = False
        from nbdist.run.monitor import MonitorPace

        self.pace = MonitorPace()  # the monitor's rhythm: fast while ranks write, slow when idle
        # What the monitor and the ending keep about the ranks, for the failure report:
        self.stop_lock = threading.Lock()
        self.stopping: str | None = None  # the status a stop under way ends the run with
        self.exit_seen: dict[int, float] = {}  # local rank -> when it was seen gone (the root cause is the first)
        self.engine_root: int | None = None  # the rank an engine (torchrun) named as the first failure
        self.unloadable: dict[int, str] = {}  # global rank -> why its value could not be loaded
        self.timed_out: dict[int, tuple] = {}  # global rank -> (its stack dump, whether it was in user code)
        # A session's ranks that nbdist started itself: one that dies is the session's to handle (its
        # survivors keep their state), not a reason to stop the rest. The run ends once none is left.
        self.keep_survivors = False
        self.start_env: dict[str, str] = {}  # the env the launcher started the ranks with (a replacement's too)

    # ---- public state -------------------------------------------------------------------
    @property
    def status(self) -> str:
        return self._status

    @property
    def results(self) -> dict:
        """rank -> return value of every rank that has finished so far, in rank order."""
        return dict(sorted(self._results.items()))

    @property
    def pids(self) -> dict[int, int]:
        """rank -> pid of the rank process."""
        return {self.global_rank(r): pid for r, pid in self.launcher.pids.items()}

    def local_pids(self) -> dict[int, int]:
        """rank -> pid of the ranks on this machine: the only ones a signal may reach."""
        elsewhere = self.launcher.remote_slots()
        return {self.global_rank(r): pid for r, pid in self.launcher.pids.items() if r not in elsewhere}

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def log_dir(self) -> str:
        """Where the rank logs are (a session cell's are its session's)."""
        return self.run_dir

    @property
    def label(self) -> str:
        """How a view names it."""
        return f"run {self.run_id}"

    def global_rank(self, local: int) -> int:
        return self.spec.identity_for(local).rank

    def saw_rank_go(self, grank: int) -> None:
        """A rank's own channel closed (a session's): it ended now. The engine's ranks are not the
        kernel's children, and several found gone in one tick would otherwise tie."""
        local = next((r for r in self.ranks if self.global_rank(r) == grank), None)
        if local is not None:
            self.exit_seen.setdefault(local, time.time())

    def first_gone(self) -> list[int]:
        """The global ranks seen gone first: the earliest, and any seen in the same look (a reader or
        a monitor tick that found several closed at once can't tell which went first)."""
        if not self.exit_seen:
            return []
        first = min(self.exit_seen.values())
        return sorted(self.global_rank(r) for r, t in self.exit_seen.items() if t - first <= EXITS_TIED_S)

    def replace_rank(self, grank: int, env: dict[str, str]) -> int:
        """A session's heal: start rank ``grank``, which ended, again under this run (the same marker,
        run dir and environment, plus ``env``), on the forker thread. Returns its pid."""
        from nbdist.launchers.forker import call_in_forker

        local = next(r for r in self.ranks if self.global_rank(r) == grank)
        if self.ranks[local].status not in TERMINAL or not hasattr(self.launcher, "start_replacement"):
            raise RuntimeError(f"rank {grank} of run {self.run_id} can't be replaced")
        pid = call_in_forker(self.launcher.start_replacement, local, self.run_dir, self.run_id,
                             {**self.start_env, **env})
        self.exit_seen.pop(local, None)
        self.ranks[local] = RankStatus(local, "running", pid=pid)
        self._emit(RunEvent("running", grank, self.ranks[local]))
        self.pace.wake()  # the monitor waits on the new rank's sentinel from now on
        return pid

    def await_rank_end(self, grank: int, deadline: float) -> bool:
        """Whether rank ``grank`` is seen ended (its process reaped by the monitor, which checks on
        every tick) by ``deadline`` (``time.monotonic()``): a heal undone kills its replacements, and
        the next heal may start them again only once they are."""
        while not self.rank_ended(grank):
            if time.monotonic() > deadline:
                return False
            self.pace.wake()
            time.sleep(0.01)
        return True

    def rank_ended(self, grank: int) -> bool:
        """Whether the monitor saw rank ``grank``'s process end (a heal's replacement, say)."""
        local = next(r for r in self.ranks if self.global_rank(r) == grank)
        return self.ranks[local].status in TERMINAL

    def __repr__(self) -> str:
        return f"<nbdist.Run {self.run_id} {self.status} nprocs={self.nprocs} dir={self.run_dir}>"

    # ---- events ---------------------------------------------------------------------------
    def subscribe(self, callback, replay: bool = True) -> None:
        """Call ``callback(event)`` from the monitor thread for every OutputChunk and RunEvent.

        With ``replay``, lines already read and the current rank states are sent first, so a
        view that attaches late misses nothing the run still holds in memory.
        """
        with self._pump_lock:  # no chunk is both replayed and delivered, or neither
            if replay:
                self._replay(callback, {self.global_rank(r): out.lines for r, out in self.outputs.items()})
            self._subscribers.append(callback)

    def set_rank_status(self, local: int, status: str, exitcode=None) -> None:
        """A rank's new state, told to the subscribers; a rank that ended stays ended."""
        st = self.ranks[local]
        if st.status in TERMINAL:
            return
        st.status = status
        if status in TERMINAL:
            st.ended = time.monotonic()
            st.exitcode, st.signal_name = describe_exitcode(exitcode)
        self._emit(RunEvent(status, self.global_rank(local), st))

    def pump_output(self, final: bool = False, unless_read_to: dict | None = None) -> None:
        """Read what the ranks wrote since the last pump and tell the subscribers.

        The monitor pumps on every tick; a stop in another thread pumps one last time, and a
        session cell pumps before it says it is done, ``unless_read_to`` (``{global rank: (stdout,
        stderr) sizes}`` its ranks said their logs had at the end) was read and told already: a
        silent cell reads no file.
        """
        with self._pump_lock:  # a pump under way on another thread has told what it read before this looks
            if self._pumped_final or (unless_read_to is not None and self._has_read_to(unless_read_to)):
                return
            self._pumped_final = final
            for r, out in self.outputs.items():
                pieces = self.channel.take(self.global_rank(r)) if self.channel is not None else ()
                for chunk in out.poll(final=final, pieces=pieces):
                    self.pace.note_news()
                    self._emit(chunk)

    def _has_read_to(self, sizes: dict) -> bool:
        outputs = {self.global_rank(r): out for r, out in self.outputs.items()}
        for grank, ends in sizes.items():
            out = outputs.get(grank)
            if out is None or not out.has_read_to(ends):
                return False
        return True

    def take_result(self, grank: int) -> bool:
        """Load rank ``grank``'s value, if it returned one; a value the kernel can't load (a class
        only the ranks can import) makes that rank fail, saying so, instead of the run."""
        try:
            ok, value = rundir.read_result(self.run_dir, grank)
        except Exception as exc:
            self.unloadable[grank] = (f"returned a value the kernel could not load ({type(exc).__name__}: {exc}); "
                                      f"return plain data (tensors, numbers, dicts), or make its module importable "
                                      f"in the kernel too")
            return False
        if ok:
            self._results[grank] = value
        return ok

    # ---- lifecycle --------------------------------------------------------------------------
    def begin(self) -> None:
        """The ranks started: running, with a monitor thread (:mod:`nbdist.run.monitor`)."""
        from nbdist.run.monitor import start_monitor

        self._status = "running"
        self._emit(RunEvent("running"))
        _LIVE_RUNS.add(self)
        start_monitor(self)

    def end(self, status: str) -> None:
        """The last step of :func:`nbdist.run.ending.finalize`: the run has ended, as ``status``."""
        self._status = status
        self.ended = time.monotonic()
        _LIVE_RUNS.discard(self)
        self._done.set()
        self.pace.wake()  # the monitor sees the end now, not a quiet tick later, and closes the pace
        self._emit(RunEvent(status, None, self.error or self.report))

    # ---- what users call ------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> dict:
        """Block until the run ends; return ``{rank: value}`` or raise its error.

        KeyboardInterrupt while waiting interrupts the run (nothing is left running), then
        propagates. ``timeout`` here only limits the wait: on expiry TimeoutError is raised and the
        run goes on.
        """
        self._wait_until_done(timeout)
        if self.error is not None:
            raise self.error
        return self.results

    def interrupt(self) -> StopReport:
        """Stop every rank and its children: SIGINT, then SIGTERM, then SIGKILL, one deadline."""
        return ending.stop(self, "interrupted", INTERRUPT_LADDER, timeout=self.stop_timeout)

    def kill(self) -> StopReport:
        """Stop every rank and its children now: SIGTERM, then SIGKILL."""
        return ending.stop(self, "killed", KILL_LADDER, timeout=min(self.stop_timeout, 2.0))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self.done:
            self.interrupt()
        return False


def _stop_live_runs() -> None:
    # A script that ends with runs in flight must not leave them behind (the ranks' watchdogs
    # would catch it too, but only after this process is gone).
    for run in live_runs():
        with contextlib.suppress(Exception):
            run.kill()


close_at_exit("runs", _stop_live_runs)
