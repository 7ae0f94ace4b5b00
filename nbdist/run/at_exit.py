"""What a kernel ends when it exits, in one order: sessions, then runs, then its store host and warm templates.

Sessions go first so that their ranks leave their loop and run their own atexit handlers (loggers,
trackers, checkpoints) as :meth:`nbdist.Session.close` promises; then the runs still in flight are
stopped; the warm templates go last, since warm ranks die with their template. One ``atexit`` hook
runs the steps in that order, whatever order their modules happened to be imported in (``atexit``
alone runs hooks in the reverse order of their registration, which is the import order).

A template left running here would end anyway (end-of-file on its control socket, PDEATHSIG), as
would every rank (the parent watch): this only makes the ending graceful and ordered.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys

__all__ = ["close_at_exit", "STEPS"]

STEPS = ("sessions", "runs")
_CLOSERS: dict[str, list] = {step: [] for step in STEPS}
log = logging.getLogger(__name__)


def close_at_exit(step: str, closer) -> None:
    """Call ``closer()`` when the kernel exits, in ``step`` ("sessions" or "runs")."""
    if closer not in _CLOSERS[step]:
        _CLOSERS[step].append(closer)


@atexit.register
def _end_everything() -> None:
    for step in STEPS:
        for closer in _CLOSERS[step]:
            try:
                closer()
            except Exception:  # one that fails must not keep the others from running
                log.exception("nbdist: closing %s at exit failed", step)
    hosts = sys.modules.get("nbdist.launchers.store_host")  # the runs' stores, once no run needs them
    if hosts is not None:
        with contextlib.suppress(Exception):
            hosts.close_store_hosts()
    handle = sys.modules.get("nbdist.warmstart.handle")  # only if this kernel ever started a template
    if handle is not None:
        with contextlib.suppress(Exception):
            handle.close_templates()
