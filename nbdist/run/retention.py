"""How long run dirs stay: what a person needs is kept, the rest goes by age and total size.

A run dir outlives its kernel on purpose (the logs of a run that failed are the first thing one
reads). What is big in it is not what one reads: the payload (a pushed 256 MB tensor is one) and
the results are deleted as soon as the run or cell that needed them has ended
(:func:`discard_data`). Whole run dirs then go by age and total size (:func:`prune_runs`):

* a run dir is kept while its run lives (it has not ended and its kernel lives), and while a
  process that carries its marker is alive;
* an ended one goes ``NBDIST_RUNS_KEEP_DAYS`` days (default 7) after its last write;
* past ``NBDIST_RUNS_MAX_MB`` megabytes (default 1024) in all, the oldest ended ones go first,
  runs that finished before runs that failed or were stopped (their logs say why).

Pruning runs at most every few minutes, on a thread, when a run starts: never on the launch path.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field

__all__ = ["KEEP_DAYS_ENV", "MAX_MB_ENV", "Retention", "retention", "discard_data", "mark_ended", "prune_runs",
           "prune_in_background", "describe_retention"]

KEEP_DAYS_ENV = "NBDIST_RUNS_KEEP_DAYS"
MAX_MB_ENV = "NBDIST_RUNS_MAX_MB"
ENDED_FILE = "ended.json"
_DATA = ("payload.pkl", "pushed.pkl")  # and result.{R}.pkl (pull.pkl goes once the kernel read it)
_EVERY_S = 300.0
_LAST = {"root": None, "at": 0.0}
_LOCK = threading.Lock()
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    """The setting: days an ended run dir is kept, and megabytes all of them may take."""

    keep_days: float = 7.0
    max_mb: float = 1024.0


def retention(env=os.environ) -> Retention:
    """The retention set in the environment, or the defaults; a value that isn't a number is ignored."""
    def number(name, default):
        try:
            value = float(env.get(name, default))
        except ValueError:
            return default
        return value if value >= 0 else default

    return Retention(number(KEEP_DAYS_ENV, 7.0), number(MAX_MB_ENV, 1024.0))


def describe_retention(root: str) -> str:
    """One line for ``nbdist ps`` and ``%dist_logs``: where the logs are and how long they stay."""
    r = retention()
    return (f"run dirs (logs) are in {root}: each is kept {r.keep_days:g} days after its run ended, and past "
            f"{r.max_mb:g} MB in all the oldest go first, failed runs last ({KEEP_DAYS_ENV}, {MAX_MB_ENV})")


def discard_data(run_dir: str, ranks=None) -> int:
    """Delete what a run or cell that ended no longer needs (its payload, and the results of
    ``ranks``, which the kernel read already): the bulk of a run dir. The logs, the spec, errors
    and the cell's source stay, and so do results of ranks another kernel reads. Returns bytes freed."""
    freed = 0
    try:
        names = os.listdir(run_dir)
    except OSError:
        return 0
    results = {f"result.{r}.pkl" for r in ranks or ()}
    for name in names:
        if name in _DATA or name in results:
            path = os.path.join(run_dir, name)
            try:
                freed += os.path.getsize(path)
                os.unlink(path)
            except OSError:
                pass
    return freed


def mark_ended(run_dir: str, status: str) -> None:
    """Record that the run ended, and how: pruning may take its dir once it is old (and adds the
    dir's size to this record the first time it walks it, off the run's way out)."""
    _write_ended(run_dir, {"status": status, "time": time.time()})


def _write_ended(run_dir: str, record: dict) -> None:
    from nbdist.protocol.rundir import write_private

    try:
        write_private(os.path.join(run_dir, ENDED_FILE), json.dumps(record).encode())
    except OSError:  # the run dir is gone or read-only: nothing to keep track of
        pass


@dataclass
class _RunDir:
    path: str
    size: int
    last_write: float
    ended: str | None  # its status, "lost" when its kernel died without saying, None while it lives

    @property
    def failed(self) -> bool:
        return self.ended not in (None, "finished")


@dataclass
class PruneReport:
    """What a prune did."""

    removed: list[str] = field(default_factory=list)
    freed: int = 0
    kept: int = 0


def _measure(path: str) -> tuple[int, float]:
    size, newest = 0, os.lstat(path).st_mtime
    for folder, dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            size += st.st_size
            newest = max(newest, st.st_mtime)
    return size, newest


def _read_ended(path: str) -> dict | None:
    try:
        with open(os.path.join(path, ENDED_FILE)) as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _ended(path: str, record: dict | None) -> str | None:
    from nbdist.run.processes import find_owner

    if record is not None:
        return str(record.get("status", "ended"))
    owner = find_owner(path)
    if owner is not None and owner.alive is False:
        return "lost"  # its kernel died without ending it
    return None


def _look_at(path: str) -> _RunDir:
    """An ended run by the record it left (one small file); any other by walking it. An ended run
    only shrinks: the first walk of one adds its size to its record, and no prune walks it again."""
    record = _read_ended(path)
    when = (record or {}).get("time")
    if not isinstance(when, (int, float)):  # no record: it lives, or its kernel died without ending it
        size, newest = _measure(path)
        return _RunDir(path, size, newest, _ended(path, record))
    size = record.get("size")
    if not isinstance(size, int):
        size = _measure(path)[0]
        _write_ended(path, {**record, "size": size})
    return _RunDir(path, size, float(when), str(record.get("status", "ended")))


def _busy_run_dirs() -> set[str]:
    """Run dirs that a live process still carries in its marker (an orphan's logs are its story)."""
    from nbdist.run.processes import find_marked

    return {os.path.realpath(p.run_dir) for p in find_marked() if p.run_dir}


def prune_runs(root: str, now: float | None = None, setting: Retention | None = None) -> PruneReport:
    """Remove the run dirs under ``root`` that :data:`retention` lets go; see the module docstring."""
    now = time.time() if now is None else now
    setting = setting or retention()
    busy = _busy_run_dirs()
    dirs = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if os.path.islink(path) or not os.path.isdir(path) or os.path.realpath(path) in busy:
            continue
        try:
            dirs.append(_look_at(path))
        except OSError:
            continue
        time.sleep(0)  # the kernel's own threads go first: this one shares their GIL, and is never urgent
    report = PruneReport()
    ended = [d for d in dirs if d.ended is not None]
    old = [d for d in ended if now - d.last_write > setting.keep_days * 86400]
    total = sum(d.size for d in dirs)
    doomed = {d.path for d in old}
    total -= sum(d.size for d in old)
    # Past the size cap: finished runs before failed ones, the oldest first.
    for d in sorted((d for d in ended if d.path not in doomed), key=lambda d: (d.failed, d.last_write)):
        if total <= setting.max_mb * 2**20:
            break
        doomed.add(d.path)
        total -= d.size
    for d in dirs:
        if d.path in doomed:
            shutil.rmtree(d.path, ignore_errors=True)
            report.removed.append(d.path)
            report.freed += d.size
    report.kept = len(dirs) - len(report.removed)
    return report


def prune_in_background(root: str) -> None:
    """Prune ``root`` on a thread, at most every few minutes per kernel: never on the launch path."""
    with _LOCK:
        if _LAST["root"] == root and time.monotonic() - _LAST["at"] < _EVERY_S:
            return
        _LAST.update(root=root, at=time.monotonic())

    def prune():
        try:
            prune_runs(root)
        except Exception:  # pruning is housekeeping: it never fails a run
            log.exception("nbdist: pruning %s failed", root)

    threading.Thread(target=prune, name="nbdist-prune", daemon=True).start()
