"""How a run ends: one stop, whoever asks for it, then the finalisation that reads what the ranks left.

Every stop climbs one ladder (SIGINT, SIGTERM, SIGKILL, or SIGTERM and SIGKILL for a kill)
against one deadline (:func:`nbdist.run.teardown.stop_tree`), and ends only when no rank, no
child of a rank and no marked process is left. Exception-safe from end to end: whatever raises
(EPERM from a signal, a result the kernel can't load), the run still ends, says why, and nobody
waits for ever.
"""

from __future__ import annotations

import logging
import signal
import time

from nbdist.errors import RunStoppedError, WorkerFailedError
from nbdist.run import teardown
from nbdist.run.events import TERMINAL
from nbdist.run.failure_report import collect_failures
from nbdist.run.retention import discard_data, mark_ended

__all__ = ["stop", "finalize", "INTERRUPT_LADDER", "KILL_LADDER"]

INTERRUPT_LADDER = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
KILL_LADDER = (signal.SIGTERM, signal.SIGKILL)
log = logging.getLogger(__name__)


def stop(run, status: str, signals, timeout: float, reason: str | None = None,
         error_type=WorkerFailedError) -> teardown.StopReport | None:
    """Stop ``run``'s whole tree against one deadline, then end it as ``status``.

    Only the first caller stops; a second one waits for that stop (within its deadline) and gets
    its report. A second Ctrl-C during the stop skips to SIGKILL, never leaving half a tree.
    """
    with run.stop_lock:
        first = not (run.stopping or run.done)
        if first:
            run.stopping = status
    if not first:  # another thread stops it: wait for that, within its own deadline and some
        run._done.wait(timeout + 10.0)
        return run.report
    interrupted, failed = None, None
    try:
        report = teardown.stop_tree(run.launcher.leaders(), run.run_id, signals, timeout=timeout,
                                    on_tick=run.launcher.poll)
    except KeyboardInterrupt as exc:  # a second Ctrl-C: skip to SIGKILL, but never leave half a tree
        interrupted, report = exc, _stop_again(run)
    except Exception as exc:  # EPERM from a signal, a psutil error: still end, and say so
        log.exception("nbdist: stopping run %s failed", run.run_id)
        failed, report = f"stopping its processes failed ({type(exc).__name__}: {exc})", _stop_again(run)
    finalize(run, status, report, "; ".join(x for x in (reason, failed) if x) or None, error_type)
    if interrupted is not None:
        raise interrupted
    return report


def _stop_again(run) -> teardown.StopReport | None:
    """The last resort of a stop that broke off: SIGKILL to whatever is left, by the marker too."""
    try:
        return teardown.stop_tree(run.launcher.leaders(), run.run_id, (signal.SIGKILL,), timeout=2.0,
                                  on_tick=run.launcher.poll)
    except Exception:  # noqa: BLE001 - the run still ends; its report says nothing was confirmed
        log.exception("nbdist: the last stop of run %s failed too", run.run_id)
        return None


def finalize(run, status: str, report, reason: str | None = None, error_type=WorkerFailedError) -> None:
    """Reap everything, read what the ranks left, and only then tell the world the run ended."""
    try:
        _settle_ranks(run, status)
        run.report = report
        if status == "failed":
            here = {run.global_rank(r) for r in run.ranks}
            run.error = error_type(collect_failures(run), run.results, run.run_dir, reason,
                                   elsewhere=set(range(run.spec.world_size)) - here)
        elif status in ("interrupted", "killed"):
            run.error = RunStoppedError(status, run.results, run.run_dir, report)
    except Exception as exc:
        log.exception("nbdist: ending run %s failed", run.run_id)
        status = "failed" if status == "finished" else status
        run.error = WorkerFailedError({}, run.results, run.run_dir,
                                      f"nbdist could not end the run cleanly ({type(exc).__name__}: {exc})")
    finally:
        # The payload and this kernel's results were read: the logs are what stays.
        discard_data(run.run_dir, [run.global_rank(r) for r in run.ranks])
        mark_ended(run.run_dir, status)
        run.end(status)


def _settle_ranks(run, status: str) -> None:
    """Wait briefly for the ranks' exit codes, take the engine's word, and settle each rank's status."""
    for _ in range(100):
        if all(c is not None for c in run.launcher.poll().values()):
            break
        time.sleep(0.02)
    codes, root = run.launcher.exit_report()
    for r, code in codes.items():  # the engine's word on ranks the kernel only saw go
        if r in run.ranks and run.ranks[r].status == "failed":
            run.ranks[r].exitcode = code
    run.engine_root = run.global_rank(root) if root is not None else None
    for r, code in run.launcher.poll().items():
        if run.ranks[r].status in TERMINAL:
            continue
        if run.take_result(run.global_rank(r)):  # it returned before the stop reached it
            run.set_rank_status(r, "finished", code)
        else:
            run.set_rank_status(r, status if status != "failed" else "killed", code)
    run.pump_output(final=True)
    if run.channel is not None:
        run.channel.close()
    run.launcher.close()
    if run.rendezvous is not None:
        run.rendezvous.close()
