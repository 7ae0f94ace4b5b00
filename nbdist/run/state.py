"""Run: one execution of one function on all its ranks, from start to nothing left.

:func:`nbdist.run.start.start_run` makes a Run (start-or-close). Once started, one monitor thread per run follows the ranks' logs,
reaps ranks as they exit, tears the rest down when one fails (fail-fast), and enforces the
timeout. Every stop, whoever asks for it, climbs one ladder (SIGINT, SIGTERM, SIGKILL) against
one deadline, and ends only when no rank, no child of a rank and no marked process is left.

No IPython and no signal handlers here: the front ends translate their interrupts into
:meth:`Run.interrupt`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import signal
import threading
import time
import weakref

from nbdist.errors import (RankFailure, RunStoppedError, RunTimeoutError, WorkerFailedError, describe_exitcode,
                           format_rank_set)
from nbdist.protocol import rundir
from nbdist.protocol.rundir import RunSpec
from nbdist.run import teardown
from nbdist.run.at_exit import close_at_exit
from nbdist.run.events import TERMINAL, EventSource, RankStatus, RunEvent
from nbdist.run.output import RankOutput
from nbdist.run.retention import discard_data, mark_ended
from nbdist.run.stacks import dump_stacks

__all__ = ["Run", "KILL_LADDER", "INTERRUPT_LADDER"]

log = logging.getLogger(__name__)

INTERRUPT_LADDER = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
ENGINE_REPORT_S = 2.0  # how long torchrun may take to see a rank fail, stop the rest and say which failed first
KILL_LADDER = (signal.SIGTERM, signal.SIGKILL)

_LIVE_RUNS: weakref.WeakSet = weakref.WeakSet()


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
        self._results: dict[int, object] = {}
        self.error: WorkerFailedError | None = None
        self.report: teardown.StopReport | None = None
        self.started = time.monotonic()
        self.ended: float | None = None
        self._status = "starting"
        self._subscribers = []
        self._done = threading.Event()
        self._stop_lock = threading.Lock()
        self._pump_lock = threading.Lock()
        self._pumped_final = False
        self._stopping: str | None = None
        self._exit_seen: dict[int, float] = {}
        self._engine_root: int | None = None  # the rank an engine (torchrun) named as the first failure
        self._unloadable: dict[int, str] = {}  # global rank -> why its value could not be loaded
        self._timed_out: dict[int, tuple] = {}  # global rank -> (its stack dump, whether it was in user code)
        self._monitor: threading.Thread | None = None

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

    # A one-shot run says how it ended (time, logs); a session cell that finished says nothing more.
    quiet_when_finished = False

    def saw_rank_go(self, grank: int) -> None:
        """A rank's own channel closed (a session's): it ended now. The engine's ranks are not the
        kernel's children, and several found gone in one tick would otherwise tie."""
        local = next((r for r in self.ranks if self.global_rank(r) == grank), None)
        if local is not None:
            self._exit_seen.setdefault(local, time.time())

    def global_rank(self, local: int) -> int:
        return self.spec.identity_for(local).rank

    def __repr__(self) -> str:
        return f"<nbdist.Run {self.run_id} {self.status} nprocs={self.nprocs} dir={self.run_dir}>"

    # ---- events ---------------------------------------------------------------------------
    def subscribe(self, callback, replay: bool = True) -> None:
        """Call ``callback(event)`` from the monitor thread for every OutputChunk and RunEvent.

        With ``replay``, lines already read and the current rank states are sent first, so a
        view that attaches late misses nothing the run still holds in memory.
        """
        with self._pump_lock:  # no chunk is both replayed and delivered, or neither
            self._subscribe_locked(callback, replay)

    def _subscribe_locked(self, callback, replay: bool) -> None:
        if replay:
            lines = {self.global_rank(r): out.lines for r, out in self.outputs.items()}
            self._replay(callback, lines)
        self._subscribers.append(callback)

    def _set_rank_status(self, local: int, status: str, exitcode=None) -> None:
        st = self.ranks[local]
        if st.status in TERMINAL:
            return
        st.status = status
        if status in TERMINAL:
            st.ended = time.monotonic()
            st.exitcode, st.signal_name = describe_exitcode(exitcode)
        self._emit(RunEvent(status, self.global_rank(local), st))

    # ---- lifecycle ------------------------------------------------------------------------
    def _begin(self) -> None:
        self._status = "running"
        self._track_pids()
        self._emit(RunEvent("running"))
        _LIVE_RUNS.add(self)
        self._monitor = threading.Thread(target=self._watch, name=f"nbdist-run-{self.run_id}", daemon=True)
        self._monitor.start()

    def pump_output(self, final: bool = False) -> None:
        """Read what the ranks wrote since the last pump and tell the subscribers.

        The monitor pumps on every tick; a stop in another thread pumps one last time, and a
        session cell pumps before it says it is done.
        """
        with self._pump_lock:
            if self._pumped_final:
                return
            self._pumped_final = final
            for r, out in self.outputs.items():
                pieces = self.channel.take(self.global_rank(r)) if self.channel is not None else ()
                for chunk in out.poll(final=final, pieces=pieces):
                    self._emit(chunk)

    def _watch(self) -> None:
        try:
            while not self._done.is_set():
                sentinels = self.launcher.sentinels()
                if sentinels:
                    multiprocessing.connection.wait(sentinels, timeout=0.05)
                else:
                    time.sleep(0.05)
                self.pump_output()
                if self._stopping:
                    continue  # whoever is stopping the run finishes it
                self._track_pids()
                self._reap_exited()
                failed = [r for r, st in self.ranks.items() if st.status == "failed"]
                if failed:
                    # torchrun knows how its ranks ended (not the kernel's children): let it say.
                    self.launcher.wait_for_engine(ENGINE_REPORT_S)
                    self._stop("failed", INTERRUPT_LADDER, timeout=min(self.stop_timeout, 2.0))
                elif all(st.status == "finished" for st in self.ranks.values()):
                    self._finalize("finished", None)
                elif self.timeout is not None and time.monotonic() - self.started > self.timeout:
                    self._time_out()
        except Exception:
            log.exception("nbdist monitor failed; stopping the run")
            self._stop("failed", KILL_LADDER, timeout=2.0, reason="internal error in nbdist's monitor")

    def _track_pids(self) -> None:
        """Ranks an engine starts appear when they register; spawned ranks are known at once."""
        for r, pid in self.launcher.pids.items():
            st = self.ranks.get(r)
            if st is not None and st.pid is None:
                st.pid = pid
                self._set_rank_status(r, "running")

    def _reap_exited(self) -> None:
        known = {r for r, st in self.ranks.items() if st.status in TERMINAL}
        for r, code in self.launcher.collect_exited(self.run_dir, known).items():
            self._exit_seen.setdefault(r, time.time())
            ok = self._take_result(self.global_rank(r))  # kept even if the exit went wrong after
            self._set_rank_status(r, "finished" if code == 0 and ok else "failed", code)

    def _take_result(self, grank: int) -> bool:
        """Load rank ``grank``'s value, if it returned one; a value the kernel can't load (a class
        only the ranks can import) makes that rank fail, saying so, instead of the run."""
        try:
            ok, value = rundir.read_result(self.run_dir, grank)
        except Exception as exc:
            self._unloadable[grank] = (f"returned a value the kernel could not load ({type(exc).__name__}: {exc}); "
                                       f"return plain data (tensors, numbers, dicts), or make its module importable "
                                       f"in the kernel too")
            return False
        if ok:
            self._results[grank] = value
        return ok

    def _time_out(self) -> None:
        """Dump every rank's stacks into its log (a rank still starting too), then stop the run as failed."""
        live = {r: st.pid for r, st in self.ranks.items() if st.status not in TERMINAL}
        elsewhere = self.launcher.remote_slots()  # another machine's pids: never signalled from here
        # A new rank holds the dump signal until its handler is in: it never dies of it.
        dumps = dump_stacks({r: (pid, rundir.log_path(self.run_dir, self.global_rank(r), "stderr"))
                             for r, pid in live.items() if r not in elsewhere}, timeout=2.0)
        running = rundir.read_running(self.run_dir)
        self._timed_out = {self.global_rank(r): (dumps.get(r), self.global_rank(r) in running) for r in live}
        starting = sorted(g for g, (_, in_code) in self._timed_out.items() if not in_code)
        reason = f"timed out after {self.timeout:g} s"
        if starting:
            verb = "was" if len(starting) == 1 else "were"
            where = next((d.where for g, (d, _) in sorted(self._timed_out.items()) if g in starting and d), None)
            reason += f" while {format_rank_set(starting)} {verb} still starting" + (f" ({where})" if where else "")
        self._stop("failed", INTERRUPT_LADDER, timeout=min(self.stop_timeout, 3.0),
                   reason=reason + " (stacks dumped into the rank logs)", error_type=RunTimeoutError)

    def _stop(self, status: str, signals, timeout: float, reason: str | None = None,
              error_type=WorkerFailedError) -> teardown.StopReport:
        with self._stop_lock:
            if self._stopping or self._done.is_set():
                first = False
            else:
                self._stopping = status
                first = True
        if not first:  # another thread stops it: wait for that, within its own deadline and some
            self._done.wait(timeout + 10.0)
            return self.report
        interrupted, failed = None, None
        try:
            leaders = self.launcher.leaders()
            report = teardown.stop_tree(leaders, self.run_id, signals, timeout=timeout, on_tick=self.launcher.poll)
        except KeyboardInterrupt as exc:  # a second Ctrl-C: skip to SIGKILL, but never leave half a tree
            interrupted = exc
            report = self._stop_again()
        except Exception as exc:  # EPERM from a signal, a psutil error: still end, and say so
            log.exception("nbdist: stopping run %s failed", self.run_id)
            failed = f"stopping its processes failed ({type(exc).__name__}: {exc})"
            report = self._stop_again()
        self._finalize(status, report, "; ".join(x for x in (reason, failed) if x) or None, error_type)
        if interrupted is not None:
            raise interrupted
        return report

    def _stop_again(self) -> teardown.StopReport | None:
        """The last resort of a stop that broke off: SIGKILL to whatever is left, by the marker too."""
        try:
            return teardown.stop_tree(self.launcher.leaders(), self.run_id, (signal.SIGKILL,), timeout=2.0,
                                      on_tick=self.launcher.poll)
        except Exception:  # noqa: BLE001 - the run still ends; its report says nothing was confirmed
            log.exception("nbdist: the last stop of run %s failed too", self.run_id)
            return None

    def _collect_failures(self) -> dict[int, RankFailure]:
        failures = {}
        for r, st in self.ranks.items():
            grank = self.global_rank(r)
            info = rundir.read_error(self.run_dir, grank)
            if info is None and st.status != "failed" and grank not in self._timed_out:
                continue
            exitcode, signame = describe_exitcode(st.exitcode)
            f = RankFailure(rank=grank, pid=st.pid, exitcode=exitcode, signal_name=signame,
                            time=self._exit_seen.get(r, time.time()))
            if info is not None:
                f.traceback, f.exc_type, f.message = info["traceback"], info["exc_type"], info["message"]
                f.user_traceback = info.get("user_traceback")
                f.hint, f.secondary, f.time = info.get("hint"), info.get("secondary", False), info["time"]
            elif grank in self._unloadable:
                f.message = self._unloadable[grank]
            elif grank in self._timed_out:  # stopped by the timeout: where it stood is what it said
                dump, in_code = self._timed_out[grank]
                f.message = ("running" if in_code else "still starting") + " when the timeout expired"
                if dump is not None:
                    f.message += f", {dump.where}"
                    f.traceback, f.stack = dump.main, dump.text
                elif not st.pid:
                    f.message = "had not started when the timeout expired"
                else:
                    f.message += " (it left no stack)"
            elif self._engine_root is not None and grank != self._engine_root:
                f.secondary = True  # the engine took it down after the root cause
                f.message = f"stopped by {self.launcher.name} after rank {self._engine_root} failed"
            elif self._engine_root is not None:
                f.message = None  # the engine's summary said it all: the code or signal above
            elif st.exitcode == 0:
                f.message = "exited with code 0 without returning a result"
            else:
                f.message = self._engine_said()
            failures[grank] = f
        return failures

    def _engine_said(self) -> str | None:
        """For a rank that left no traceback: what the engine (mpiexec, torchrun, srun) printed.

        A rank that can't read the run dir says so in one line there; that line is the message.
        """
        said = self.launcher.engine_log()
        worker_lines = [line for line in said.splitlines() if "nbdist.worker:" in line]
        if worker_lines:
            return worker_lines[-1].split("nbdist.worker:", 1)[1].strip()
        return f"no traceback; {self.launcher.name} said:\n{said}" if said.strip() else None

    def _finalize(self, status: str, report, reason: str | None = None, error_type=WorkerFailedError) -> None:
        """Reap everything, read what the ranks left, and only then tell the world.

        Exception-safe: whatever raises here (a result the kernel can't unpickle, an engine that
        won't say), the run still ends, with an error that says why, and nobody waits for ever.
        """
        try:
            self._settle_ranks(status)
            self.report = report
            if status == "failed":
                here = {self.global_rank(r) for r in self.ranks}
                self.error = error_type(self._collect_failures(), self.results, self.run_dir, reason,
                                        elsewhere=set(range(self.spec.world_size)) - here)
            elif status in ("interrupted", "killed"):
                self.error = RunStoppedError(status, self.results, self.run_dir, report)
        except Exception as exc:
            log.exception("nbdist: ending run %s failed", self.run_id)
            status = "failed" if status == "finished" else status
            self.error = WorkerFailedError({}, self.results, self.run_dir,
                                           f"nbdist could not end the run cleanly ({type(exc).__name__}: {exc})")
        finally:
            self._status = status
            self.ended = time.monotonic()
            # The payload and this kernel's results were read: the logs are what stays.
            discard_data(self.run_dir, [self.global_rank(r) for r in self.ranks])
            mark_ended(self.run_dir, status)
            _LIVE_RUNS.discard(self)
            self._done.set()
            self._emit(RunEvent(status, None, self.error or report))

    def _settle_ranks(self, status: str) -> None:
        """Wait briefly for the ranks' exit codes, take the engine's word, and settle each rank's status."""
        for _ in range(100):
            codes = self.launcher.poll()
            if all(c is not None for c in codes.values()):
                break
            time.sleep(0.02)
        codes, root = self.launcher.exit_report()
        for r, code in codes.items():  # the engine's word on ranks the kernel only saw go
            if r in self.ranks and self.ranks[r].status == "failed":
                self.ranks[r].exitcode = code
        self._engine_root = self.global_rank(root) if root is not None else None
        for r, code in self.launcher.poll().items():
            st = self.ranks[r]
            grank = self.global_rank(r)
            if st.status in TERMINAL:
                continue
            if self._take_result(grank):  # returned before the stop reached it (it may have been stopped while exiting)
                self._set_rank_status(r, "finished", code)
            else:
                self._set_rank_status(r, status if status != "failed" else "killed", code)
        self.pump_output(final=True)
        if self.channel is not None:
            self.channel.close()
        self.launcher.close()
        if self.rendezvous is not None:
            self.rendezvous.close()

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

    def interrupt(self) -> teardown.StopReport:
        """Stop every rank and its children: SIGINT, then SIGTERM, then SIGKILL, one deadline."""
        return self._stop("interrupted", INTERRUPT_LADDER, timeout=self.stop_timeout)

    def kill(self) -> teardown.StopReport:
        """Stop every rank and its children now: SIGTERM, then SIGKILL."""
        return self._stop("killed", KILL_LADDER, timeout=min(self.stop_timeout, 2.0))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self.done:
            self.interrupt()
        return False


def _stop_live_runs() -> None:
    # A script that ends with runs in flight must not leave them behind (the ranks' watchdogs
    # would catch it too, but only after this process is gone).
    for run in list(_LIVE_RUNS):
        with contextlib.suppress(Exception):
            run.kill()


close_at_exit("runs", _stop_live_runs)
