"""What each rank of a failed run said, from what it left: its error record, the timeout's stack dump,
the engine's summary or log. The root cause among them is :class:`nbdist.errors.WorkerFailedError`'s
to name (the first rank to fail, never one that only lost its peers)."""

from __future__ import annotations

import time

from nbdist.errors import RankFailure, describe_exitcode
from nbdist.protocol import rundir
from nbdist.run.events import EXITS_TIED_S

__all__ = ["collect_failures", "engine_said"]


def collect_failures(run) -> dict[int, RankFailure]:
    """``{global rank: RankFailure}`` of every rank of ``run`` that failed, was timed out, or left an error."""
    failures = {}
    for r, st in run.ranks.items():
        grank = run.global_rank(r)
        info = rundir.read_error(run.run_dir, grank)
        if info is None and st.status != "failed" and grank not in run.timed_out:
            continue
        exitcode, signame = describe_exitcode(st.exitcode)
        if info is not None:
            failures[grank] = RankFailure.from_record(grank, st.pid, info, exitcode, signame)
            continue
        f = RankFailure(rank=grank, pid=st.pid, exitcode=exitcode, signal_name=signame,
                        time=run.exit_seen.get(r, time.time()))
        if grank in run.unloadable:
            f.message = run.unloadable[grank]
        elif grank in run.timed_out:  # stopped by the timeout: where it stood is what it said
            _say_where_it_stood(f, *run.timed_out[grank])
        elif run.engine_root is not None and grank != run.engine_root:
            f.secondary = True  # the engine took it down after the root cause
            f.message = f"stopped by {run.launcher.name} after rank {run.engine_root} failed"
        elif run.engine_root is not None:
            f.message = None  # the engine's summary said it all: the code or signal above
        elif st.exitcode == 0:
            f.message = "exited with code 0 without returning a result"
        else:
            f.message = engine_said(run.launcher)
        failures[grank] = f
    if run.engine_root is None:
        _tell_own_deaths_from_peers(run, failures)
    return failures


_FATAL = "Fatal Python error: "  # what faulthandler writes as a rank dies of SIGSEGV, SIGABRT, ...


def _tell_own_deaths_from_peers(run, failures: dict[int, RankFailure]) -> None:
    """Ranks that left no record and were seen gone together: the one whose log says it died of a
    fatal signal is the root cause, the others were taken down after it (mpirun and srun kill a
    dead rank's peers within milliseconds, and say nothing the kernel reads; a kernel slower than
    that sees both gone at once, and the lower rank's exit first)."""
    bare = {r: f for r, f in failures.items()
            if f.traceback is None and not f.secondary and r not in run.timed_out and r not in run.unloadable}
    fatal = {r: line for r in bare if (line := _fatal_line(run.run_dir, r))}
    if not fatal or len(fatal) == len(bare):
        return
    first = min(fatal, key=lambda r: (bare[r].time, r))
    for r, f in bare.items():
        if r in fatal:
            if f.message is None or f.message.startswith("no traceback"):
                f.message = fatal[r]
        elif abs(f.time - bare[first].time) <= EXITS_TIED_S:
            f.secondary = True
            f.message = f"stopped by {run.launcher.name} after rank {first} failed"


def _fatal_line(run_dir: str, rank: int) -> str | None:
    """faulthandler's "Fatal Python error: ..." line in the end of the rank's stderr log, if any."""
    try:
        with open(rundir.log_path(run_dir, rank, "stderr"), "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 16384))
            tail = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    at = tail.rfind(_FATAL)
    return tail[at:].split("\n", 1)[0].strip() if at >= 0 else None


def _say_where_it_stood(f: RankFailure, dump, in_code: bool) -> None:
    f.message = ("running" if in_code else "still starting") + " when the timeout expired"
    if dump is not None:
        f.message += f", {dump.where}"
        f.traceback, f.stack = dump.main, dump.text
    elif not f.pid:
        f.message = "had not started when the timeout expired"
    else:
        f.message += " (it left no stack)"


def engine_said(launcher) -> str | None:
    """For a rank that left no traceback: what the engine (mpiexec, torchrun, srun) printed.

    A rank that can't read the run dir says so in one line there; that line is the message.
    """
    said = launcher.engine_log()
    worker_lines = [line for line in said.splitlines() if "nbdist.worker:" in line]
    if worker_lines:
        return worker_lines[-1].split("nbdist.worker:", 1)[1].strip()
    return f"no traceback; {launcher.name} said:\n{said}" if said.strip() else None
