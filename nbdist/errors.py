"""What crosses layers when something goes wrong: rank failures and the errors built from them."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

__all__ = [
    "LaunchConfigError",
    "UntrustedRunsRoot",
    "RankFailure",
    "WorkerFailedError",
    "RunTimeoutError",
    "RunStoppedError",
    "SessionLostError",
    "RankGoneError",
    "describe_exitcode",
    "format_rank_set",
    "root_cause_rank",
]


class LaunchConfigError(ValueError):
    """Bad input to ``launch`` or ``%%distributed``, raised before any process starts."""


class UntrustedRunsRoot(LaunchConfigError, PermissionError):
    """The folder for run dirs could let another user swap a payload (a symlink, a folder others can
    write): refused in one line that says what to do, before anything is written."""


def describe_exitcode(exitcode: int | None) -> tuple[int | None, str | None]:
    """Return ``(exitcode, signal_name)``; multiprocessing reports death by signal N as ``-N``."""
    if exitcode is None or exitcode >= 0:
        return exitcode, None
    try:
        return exitcode, signal.Signals(-exitcode).name
    except ValueError:
        return exitcode, f"signal {-exitcode}"


def format_rank_set(ranks) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2,5"``; one rank -> ``"rank 3"``."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    parts, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(parts)


@dataclass
class RankFailure:
    """One rank's failure: who it was, how it ended, and what it said.

    ``traceback`` is the rank's formatted Python traceback (nbdist's own frames removed), or
    ``None`` when the rank died without raising (``os._exit``, a signal, a segfault).
    """

    rank: int
    pid: int | None
    exitcode: int | None
    signal_name: str | None = None
    traceback: str | None = None
    user_traceback: str | None = None
    exc_type: str | None = None
    message: str | None = None
    hint: str | None = None
    time: float = 0.0
    secondary: bool = False  # a consequence of another rank's death (peer closed the connection)
    stack: str | None = None  # every thread's stack when a timeout stopped the rank (faulthandler's dump)

    @classmethod
    def from_record(cls, rank: int, pid, info: dict, exitcode=None, signal_name=None) -> RankFailure:
        """From the error record a rank left (``error.{R}.json``, a session's reply, an attached
        rank's gather): what :func:`nbdist.worker.exceptions.describe_exception` wrote."""
        import time

        return cls(rank=rank, pid=info.get("pid", pid) if pid is None else pid, exitcode=exitcode,
                   signal_name=signal_name, traceback=info.get("traceback"), user_traceback=info.get("user_traceback"),
                   exc_type=info.get("exc_type"), message=info.get("message"), hint=info.get("hint"),
                   time=info.get("time", time.time()), secondary=info.get("secondary", False))

    def describe(self) -> str:
        """One line: how this rank ended."""
        if self.stack is not None or (self.message and "timeout expired" in self.message):
            how = self.message  # stopped by the timeout: the signal was ours, where it stood is the news
        elif self.signal_name:
            how = f"killed by {self.signal_name}"
        elif self.exc_type:
            how = f"raised {self.exc_type}" + (f": {self.message}" if self.message else "")
        else:
            how = f"exited with code {self.exitcode}" + (f": {self.message}" if self.message else "")
        if self.exitcode is None:  # a session rank that raised lives on: no exit code to tell
            return f"{how} (pid {self.pid})"
        return f"{how} (pid {self.pid}, exit code {self.exitcode})"


def root_cause_rank(failures: dict[int, RankFailure]) -> int | None:
    """The first rank to fail; a rank that only lost its peers is never it while another failed."""
    if not failures:
        return None
    primary = [f for f in failures.values() if not f.secondary] or list(failures.values())
    return min(primary, key=lambda f: (f.time, f.rank)).rank


def _group_tracebacks(failures: dict[int, RankFailure]) -> list[tuple[list[int], RankFailure]]:
    """Identical tracebacks (or identical deaths) from several ranks are shown once."""
    groups: dict[str, tuple[list[int], RankFailure]] = {}
    for rank in sorted(failures):
        f = failures[rank]
        if f.traceback:
            # Peers report the same error with their own ports and pids: those don't make it different.
            frames, _, last = f.traceback.rstrip().rpartition("\n")
            key = frames + "\n" + re.sub(r"\d+", "#", last)
        else:
            key = f"exit:{f.exitcode}:{f.signal_name}"
        groups.setdefault(key, ([], f))[0].append(rank)
    return list(groups.values())


class WorkerFailedError(RuntimeError):
    """A run failed. ``rank`` is the root cause: the first rank to fail.

    Attributes
    ----------
    rank : int
        The rank that failed first (not a rank that only saw its peer disappear).
    failures : dict[int, RankFailure]
        Every rank that failed, by rank.
    results : dict[int, object]
        Return values of the ranks that finished before the failure.
    run_dir : str or None
        Where the full logs and tracebacks are kept.
    """

    def __init__(self, failures: dict[int, RankFailure], results=None, run_dir=None, reason=None, elsewhere=(),
                 note=None, remote_cause=None):
        self.failures = dict(failures)
        self.results = dict(results or {})
        self.run_dir = run_dir
        self.reason = reason
        self.note = note  # what nbdist did after the failure (a session re-formed its group)
        # Ranks of the world that other kernels (other nodes) run: the root cause may be there.
        self.elsewhere = sorted(elsewhere)
        self.remote_cause = remote_cause  # what that node's kernel said of it, when it said so in time
        self.rank = self._root_cause_rank()
        super().__init__(self._compose())

    def _root_cause_rank(self) -> int | None:
        return root_cause_rank(self.failures)

    @property
    def root_cause(self) -> RankFailure | None:
        return self.failures.get(self.rank) if self.rank is not None else None

    def summary(self) -> str:
        """The first line: which rank failed first, and how."""
        return self._compose().split("\n", 1)[0]

    def _render_traceback_(self) -> list[str]:
        """What IPython shows instead of nbdist's own stack: the root cause in the user's lines."""
        lines = [f"\x1b[31m{type(self).__name__}\x1b[0m: {self.summary()}"]
        root = self.root_cause
        others = sorted(r for r in self.failures if r != self.rank)
        if others:
            lines.append(f"(then {format_rank_set(others)} failed too)")
        if root is not None and (root.user_traceback or root.traceback):
            lines.append("")
            lines.extend((root.user_traceback or root.traceback).rstrip().split("\n"))
        if root is not None and root.hint:
            lines.append(f"hint: {root.hint}")
        if self.note:
            lines.append(f"nbdist: {self.note}")
        if self.run_dir and root is not None:
            lines.append(f"full traceback: {self.run_dir}/rank{root.rank}.stderr")
        elif self.run_dir:
            lines.append(f"logs: {self.run_dir} (%dist_logs prints them)")
        return lines

    def _compose(self) -> str:
        if self.rank is None:
            return self.reason or "the run failed"
        root = self.failures[self.rank]
        lines = [f"rank {self.rank} failed first: {root.describe()}"]
        remote_root = bool(self.elsewhere) and all(f.secondary for f in self.failures.values())
        if remote_root:
            # Every rank here only lost a peer: naming one of them "first" would send the user
            # to the wrong log.
            whose = "its" if len(self.failures) == 1 else "their"
            cause = (f"{self.remote_cause}; its kernel has the traceback" if self.remote_cause else
                     f"a rank on another node ({format_rank_set(self.elsewhere)}) failed first; its kernel and logs "
                     f"have the root cause")
            lines = [f"{format_rank_set(self.failures)} lost {whose} peers: {cause}"]
        if self.reason:
            lines[0] = f"{self.reason}; " + lines[0]
        others = sorted(r for r in self.failures if r != self.rank)
        consequences = [r for r in others if self.failures[r].secondary]
        if consequences and not remote_root:
            lines.append(f"then {format_rank_set(consequences)} lost their peer")
        if set(others) - set(consequences):
            lines.append(f"also failed: {format_rank_set(set(others) - set(consequences))}")
        # The root cause first; the peers that only saw it die come after.
        groups = sorted(_group_tracebacks(self.failures), key=lambda g: self.rank not in g[0])
        for ranks, f in groups:
            if f.traceback:
                lines.append(f"--- traceback from {format_rank_set(ranks)} ---")
                lines.append(f.traceback.rstrip())
            if f.hint:
                lines.append(f"hint: {f.hint}")
        if self.note:
            lines.append(f"nbdist: {self.note}")
        if self.run_dir:
            lines.append(f"logs: {self.run_dir}")
        return "\n".join(lines)


class RunTimeoutError(WorkerFailedError, TimeoutError):
    """The run's ``timeout`` expired; every rank's stack was dumped into its log before the stop.

    ``failures`` has every rank the timeout stopped, each with its ``stack`` and a ``message``
    that says whether it was still starting or in the user's code, and where.
    """

    def _compose(self) -> str:
        lines = [self.reason or "the run timed out"]
        for ranks, f in sorted(_group_tracebacks(self.failures), key=lambda g: g[0]):
            lines.append(f"--- {format_rank_set(ranks)}: {f.message} ---")
            if f.traceback:
                lines.append(f.traceback.rstrip())
        if self.run_dir:
            lines.append(f"logs: {self.run_dir}")
        return "\n".join(lines)

    def _render_traceback_(self) -> list[str]:
        lines = self._compose().split("\n")
        return [f"\x1b[31m{type(self).__name__}\x1b[0m: {lines[0]}", *lines[1:]]


class RunStoppedError(RuntimeError):
    """The run was interrupted or killed before it finished. ``results`` holds the finished ranks."""

    def __init__(self, status: str, results=None, run_dir=None, report=None):
        self.status = status
        self.results = dict(results or {})
        self.run_dir = run_dir
        self.report = report
        msg = f"the run was {status}"
        if report is not None:
            msg += f": {report}"
        super().__init__(msg)

    def _render_traceback_(self) -> list[str]:
        """One line in a notebook: what was stopped and how fast."""
        return [f"{self.status}: {self.report}" if self.report is not None else f"{self.status}"]


class SessionLostError(RuntimeError):
    """A session's ranks are gone: one died, or one could not be brought back from C code.

    The whole tree was stopped and the ranks' state is lost. ``Session.restart()`` (or
    ``%dist_restart``) brings up new ranks. ``cause`` is the session run's own error, naming the
    rank that died and how, when there is one.

    Attributes
    ----------
    reason : str
        What happened, and what to do (said once).
    failures : dict[int, RankFailure]
        What the ranks of the cell that was running said, with how the lost rank ended.
    rank : int or None
        The root cause among them: the first rank to fail, never one that only lost its peers.
    """

    def __init__(self, reason: str, cause=None, failures=None):
        self.reason = reason
        self.cause = cause
        self.failures = {**dict(getattr(cause, "failures", None) or {}), **dict(failures or {})}
        self.rank = root_cause_rank(self.failures)
        super().__init__(self._compose())

    @property
    def root_cause(self) -> RankFailure | None:
        return self.failures.get(self.rank) if self.rank is not None else None

    def _compose(self) -> str:
        lines = [self.reason]
        root = self.root_cause
        if root is not None and f"rank {root.rank} failed first" not in self.reason:
            lines.append(f"rank {root.rank} failed first: {root.describe()}")
        others = sorted(r for r in self.failures if r != self.rank)
        consequences = [r for r in others if self.failures[r].secondary]
        if consequences:
            lines.append(f"then {format_rank_set(consequences)} lost {'its' if len(consequences) == 1 else 'their'} "
                         f"peer")
        if set(others) - set(consequences):
            lines.append(f"also failed: {format_rank_set(set(others) - set(consequences))}")
        if root is not None and root.traceback:
            lines.append(f"--- traceback from rank {root.rank} ---")
            lines.append((root.user_traceback or root.traceback).rstrip())
        return "\n".join(lines)

    def _render_traceback_(self) -> list[str]:
        lines = self._compose().split("\n")
        return [f"\x1b[31mSessionLostError\x1b[0m: {lines[0]}", *lines[1:]]


class RankGoneError(RuntimeError):
    """A cell needs ranks of a session that died; the survivors keep their state.

    Raised before anything runs. ``Session.heal()`` (``%dist_heal``) brings the ranks back from
    their peers, ``Session.restart()`` (``%dist_restart``) starts over, and a cell on the survivors
    only (``ranks=[...]``, ``--ranks``) still runs: to save what they hold, say.

    Attributes
    ----------
    gone : dict[int, str]
        Each dead rank and how it died.
    survivors : list of int
    """

    def __init__(self, gone: dict[int, str], survivors, heal: str, restart: str, subset: str):
        self.gone, self.survivors = dict(gone), list(survivors)
        one = len(self.gone) == 1
        who = "; ".join(f"rank {r} {how}" for r, how in sorted(self.gone.items()))
        them = "it" if one else "them"
        super().__init__(f"{who}: this cell needs {them}. {heal} brings {them} back from the peers; {restart}; "
                         f"{subset} runs on the survivors, their state kept")

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[31mRankGoneError\x1b[0m: {self}"]
