"""A run's monitor: one thread that follows the ranks' logs, reaps ranks as they exit, stops the rest
when one fails (fail-fast), ends the run when all finished, and enforces its timeout."""

from __future__ import annotations

import logging
import multiprocessing.connection
import threading
import time

from nbdist.errors import RunTimeoutError, format_rank_set
from nbdist.protocol import rundir
from nbdist.run import ending
from nbdist.run.events import TERMINAL
from nbdist.run.stacks import dump_stacks

__all__ = ["start_monitor", "ENGINE_REPORT_S", "TICK_S"]

ENGINE_REPORT_S = 2.0  # how long torchrun may take to see a rank fail, stop the rest and say which failed first
TICK_S = 0.05  # between two looks, unless a rank's exit wakes the monitor first
log = logging.getLogger(__name__)


def start_monitor(run) -> threading.Thread:
    """The ranks the launcher knows are running now; the thread takes it from there."""
    track_pids(run)
    thread = threading.Thread(target=_watch, args=(run,), name=f"nbdist-run-{run.run_id}", daemon=True)
    thread.start()
    return thread


def _watch(run) -> None:
    try:
        while not run.done:
            sentinels = run.launcher.sentinels()
            if sentinels:
                multiprocessing.connection.wait(sentinels, timeout=TICK_S)
            else:
                time.sleep(TICK_S)
            run.pump_output()
            if run.stopping:
                continue  # whoever is stopping the run finishes it
            track_pids(run)
            reap_exited(run)
            if any(st.status == "failed" for st in run.ranks.values()):
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
    running = rundir.read_running(run.run_dir)
    run.timed_out = {run.global_rank(r): (dumps.get(r), run.global_rank(r) in running) for r in live}
    starting = sorted(g for g, (_, in_code) in run.timed_out.items() if not in_code)
    reason = f"timed out after {run.timeout:g} s"
    if starting:
        verb = "was" if len(starting) == 1 else "were"
        where = next((d.where for g, (d, _) in sorted(run.timed_out.items()) if g in starting and d), None)
        reason += f" while {format_rank_set(starting)} {verb} still starting" + (f" ({where})" if where else "")
    ending.stop(run, "failed", ending.INTERRUPT_LADDER, timeout=min(run.stop_timeout, 3.0),
                reason=reason + " (stacks dumped into the rank logs)", error_type=RunTimeoutError)
