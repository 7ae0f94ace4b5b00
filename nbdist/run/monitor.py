"""A run's monitor: one thread that follows the ranks' logs, reaps ranks as they exit, stops the rest
when one fails (fail-fast; a session that keeps its survivors is told instead, through the rank's
event), ends the run when all finished, and enforces its timeout."""

from __future__ import annotations

import logging
import multiprocessing.connection
import threading
import time

from nbdist.errors import RunTimeoutError, format_rank_set
from nbdist.protocol import registration, rundir
from nbdist.run import ending
from nbdist.run.events import TERMINAL
from nbdist.run.stacks import dump_stacks

__all__ = ["start_monitor", "MonitorPace", "ENGINE_REPORT_S", "TICK_S", "QUIET_TICK_S"]

ENGINE_REPORT_S = 2.0  # how long torchrun may take to see a rank fail, stop the rest and say which failed first
TICK_S = 0.05  # between two looks while ranks write (live output), unless a rank's exit wakes the monitor first
# Once nothing new came for QUIET_AFTER_S (an idle session, a long silent step), looks are this far
# apart: each look stats two logs per rank, and at 50 ms an idle 32-rank session cost the kernel
# 2.3% of a core. A rank's exit still wakes the monitor at once (its sentinel), and so does a new
# session cell (wake()); the first line after a quiet spell shows within this.
QUIET_TICK_S = 0.5
QUIET_AFTER_S = 2.0
log = logging.getLogger(__name__)


class MonitorPace:
    """How long the monitor waits between looks: short while there is news, long once quiet, and
    woken at once by :meth:`wake` (a pipe among the waited-on sentinels, so no tick is needed)."""

    def __init__(self):
        self._reader, self._writer = multiprocessing.connection.Pipe(duplex=False)
        self.last_news = time.monotonic()

    def note_news(self) -> None:
        self.last_news = time.monotonic()

    def wake(self) -> None:
        """Look now, and keep looking often for a while (a cell was just sent to the ranks)."""
        self.note_news()
        try:
            self._writer.send_bytes(b"!")
        except OSError:  # the run ended and closed it
            pass

    def wait(self, sentinels: list, fast: bool = False) -> None:
        quiet = not fast and time.monotonic() - self.last_news > QUIET_AFTER_S
        try:
            ready = multiprocessing.connection.wait(list(sentinels) + [self._reader],
                                                    timeout=QUIET_TICK_S if quiet else TICK_S)
            while self._reader in ready and self._reader.poll():
                self._reader.recv_bytes()
        except OSError:  # closed under us: the run is ending
            time.sleep(TICK_S)

    def close(self) -> None:
        self._reader.close()
        self._writer.close()


def start_monitor(run) -> threading.Thread:
    """The ranks the launcher knows are running now; the thread takes it from there."""
    track_pids(run)
    thread = threading.Thread(target=_watch, args=(run,), name=f"nbdist-run-{run.run_id}", daemon=True)
    thread.start()
    return thread


def _watch(run) -> None:
    try:
        while not run.done:
            # Ranks still starting (or a timeout to enforce) want frequent looks; idle ones don't.
            run.pace.wait(run.launcher.sentinels(), fast=run.status == "starting")
            run.pump_output()
            if run.stopping:
                continue  # whoever is stopping the run finishes it
            track_pids(run)
            reap_exited(run)
            if any(st.status == "failed" for st in run.ranks.values()) and not _survivors_kept(run):
                # torchrun knows how its ranks ended (not the kernel's children): let it say.
                run.launcher.wait_for_engine(ENGINE_REPORT_S)
                ending.stop(run, "failed", ending.INTERRUPT_LADDER, timeout=min(run.stop_timeout, 2.0))
            elif all(st.status == "finished" for st in run.ranks.values()):
                with run.stop_lock:  # a stop that came meanwhile ends it instead
                    finishing = not run.stopping
                    if finishing:
                        run.stopping = "finished"
                if finishing:
                    ending.finalize(run, "finished", None)
            elif run.timeout is not None and time.monotonic() - run.started > run.timeout:
                time_out(run)
    except Exception:
        log.exception("nbdist monitor failed; stopping the run")
        ending.stop(run, "failed", ending.KILL_LADDER, timeout=2.0, reason="internal error in nbdist's monitor")
    finally:
        run.pace.close()


def _survivors_kept(run) -> bool:
    """A session keeps its survivors (it heard of the death through the rank's event): the run goes
    on while one of them lives."""
    return run.keep_survivors and any(st.status not in TERMINAL for st in run.ranks.values())


def track_pids(run) -> None:
    """Ranks an engine starts appear when they register; spawned ranks are known at once."""
    for r, pid in run.launcher.pids.items():
        st = run.ranks.get(r)
        if st is not None and st.pid is None:
            st.pid = pid
            run.set_rank_status(r, "running")


def reap_exited(run) -> None:
    """Each rank that exited since the last look: finished with its value, or failed."""
    known = {r for r, st in run.ranks.items() if st.status in TERMINAL}
    for r, code in run.launcher.collect_exited(run.run_dir, known).items():
        run.exit_seen.setdefault(r, time.time())
        ok = run.take_result(run.global_rank(r))  # kept even if the exit went wrong after
        run.set_rank_status(r, "finished" if code == 0 and ok else "failed", code)


def time_out(run) -> None:
    """Dump every rank's stacks into its log (a rank still starting too), then stop the run as failed."""
    live = {r: st.pid for r, st in run.ranks.items() if st.status not in TERMINAL}
    elsewhere = run.launcher.remote_slots()  # another machine's pids: never signalled from here
    # A new rank holds the dump signal until its handler is in: it never dies of it.
    dumps = dump_stacks({r: (pid, rundir.log_path(run.run_dir, run.global_rank(r), "stderr"))
                         for r, pid in live.items() if r not in elsewhere}, timeout=2.0)
    running = registration.read_running(run.run_dir)
    run.timed_out = {run.global_rank(r): (dumps.get(r), run.global_rank(r) in running) for r in live}
    starting = sorted(g for g, (_, in_code) in run.timed_out.items() if not in_code)
    reason = f"timed out after {run.timeout:g} s"
    if starting:
        verb = "was" if len(starting) == 1 else "were"
        where = next((d.where for g, (d, _) in sorted(run.timed_out.items()) if g in starting and d), None)
        reason += f" while {format_rank_set(starting)} {verb} still starting" + (f" ({where})" if where else "")
    ending.stop(run, "failed", ending.INTERRUPT_LADDER, timeout=min(run.stop_timeout, 3.0),
                reason=reason + " (stacks dumped into the rank logs)", error_type=RunTimeoutError)
