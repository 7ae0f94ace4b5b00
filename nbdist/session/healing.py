"""The heal: a degraded session's dead ranks started again and rebuilt from their peers.

``Session.heal(donor=None)`` (``%dist_heal [--from R]``), in three timed phases:

1. *start*: the donor (the lowest survivor, or the one named) says which groups it made, in order
   (:mod:`nbdist.worker.group_replay`); each dead rank is started again under the same run (forked
   from the warm template where it serves, else spawned), with the same rank number, device,
   environment and marker;
2. *re-form*: the survivors re-form every group in place under a new generation, while the new
   rank makes the donor's groups in the donor's order under that generation; so each group meets,
   and the survivors' group objects (the default group, ``new_group``'s, what DDP holds) stay the
   same objects. Every survivor's DDP reducers are reset, as the new rank's are fresh;
3. *copy*: every survivor fingerprints each of its names; what is the same on all of them is
   copied from the donor in one dump (:mod:`nbdist.worker.namespace_copy`). With one survivor there
   is nothing to compare: only what nbdist knows is alike is copied (modules, DDP models and their
   optimizers, the functions and classes of cells that ran on every rank), the rest is listed as
   not judged. The replicas are then compared as after a stop.

Anything that fails on the way stops the replacements, and the survivors are told again which
ranks their groups lack: the session is degraded as before, and says why. A cell sent meanwhile
waits (the session is "healing").
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from dataclasses import dataclass, field

from nbdist.errors import SessionLostError, format_rank_set
from nbdist.protocol import rundir
from nbdist.protocol.session_channel import HEAL_FILE_ENV, HEAL_GENERATION_ENV, read_session_key
from nbdist.protocol.shared_values import dump_shared, reshare
from nbdist.run.rank_listener import RankListener
from nbdist.session.cell_history import CellRecord
from nbdist.session.rank_deaths import begin_reform, degrade_until_told, describe_gone, tell_untold_deaths
from nbdist.session.internal_calls import call_on_ranks

__all__ = ["heal", "HealReport", "HEAL_CONNECT_S"]

REAP_WAIT_S = 10.0  # a SIGKILLed replacement is reaped by the run's monitor within a tick
HEAL_CONNECT_S = 90.0  # a spawned replacement imports torch before it joins; the survivors wait that long


@dataclass
class HealReport:
    """What a heal did, for its one message (:meth:`describe`) and for tests."""

    healed: list[int]
    donor: int
    copied: list[str] = field(default_factory=list)
    rank_specific: list[str] = field(default_factory=list)  # values that differ between survivors
    partial: list[str] = field(default_factory=list)  # held by some survivors only
    unpicklable: dict[str, str] = field(default_factory=dict)
    not_judged: list[str] = field(default_factory=list)  # one survivor: nothing to compare with
    seconds: dict[str, float] = field(default_factory=dict)  # start, reform, copy
    replicas: str | None = None  # DDP replicas apart after the copy, and what to do

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        ranks = format_rank_set(self.healed)
        s = self.seconds
        lines = [f"healed {ranks} from rank {self.donor} in {sum(s.values()):.1f} s (start {s.get('start', 0):.1f} s, "
                 f"re-form {s.get('reform', 0):.1f} s, copy {s.get('copy', 0):.1f} s): {len(self.copied)} names copied"]
        if self.rank_specific:
            lines.append(f"rank-specific, not copied (they differ between survivors): {', '.join(self.rank_specific)}")
        if self.partial:
            lines.append(f"not copied (only some survivors hold them): {', '.join(self.partial)}")
        if self.not_judged:
            lines.append(f"not copied (one survivor: nothing to compare with): {', '.join(self.not_judged)}")
        if self.unpicklable:
            lines.append("could not be copied: " + "; ".join(f"{n} ({why})" for n, why in self.unpicklable.items()))
        if self.rank_specific or self.partial or self.not_judged or self.unpicklable:
            lines.append(f"{ranks} lacks those: set them in a cell with --ranks {','.join(map(str, self.healed))} "
                         f"(ranks=[...]), or reload them from a checkpoint")
        if self.replicas:
            lines.append(self.replicas)
        return "\n".join(lines)


def refuse_heal(inc, donor) -> None:
    """Raise RuntimeError, in one line, where this incarnation can't be healed now."""
    engine = getattr(inc.engine, "name", None)
    if inc.ended or not inc.rank_run or not inc.rank_run.keep_survivors:
        if engine is not None:
            raise RuntimeError(f"nbdist can't heal ranks that {engine} started: {engine} ends the survivors itself "
                               f"when a rank dies, and can't add one process; {inc.restart_hint}")
        if inc.options.nnodes > 1:
            raise RuntimeError(f"nbdist can't heal a rank on another node; {inc.restart_hint}")
        why = inc.lost_reason or f"the session is {inc.status}"
        raise RuntimeError(f"nothing to heal from: {why.rstrip('.')}; {inc.restart_hint}"
                           if inc.ended else f"nothing to heal: every rank is alive ({inc.status})")
    if inc.life.state != "degraded":
        what = "every rank is alive" if not inc.gone else f"the session is {inc.status}"
        raise RuntimeError(f"nothing to heal now: {what}")
    if donor is not None and donor not in inc.pids:
        raise RuntimeError(f"rank {donor} can't be the donor: the survivors are {format_rank_set(inc.pids)}")


def heal(inc, donor: int | None = None) -> HealReport:
    """Bring ``inc``'s dead ranks back from ``donor`` (default: the lowest survivor); see the module."""
    from nbdist.worker import group_replay

    refuse_heal(inc, donor)
    with inc.lock:
        if not inc.life.move("healing", only_from=("degraded",)):
            raise RuntimeError(f"nothing to heal now: the session is {inc.status}")
        inc.replacements_dead = {}
    dead, survivors = sorted(inc.gone), sorted(inc.pids)
    donor = survivors[0] if donor is None else donor
    report = HealReport(healed=dead, donor=donor)
    started: dict[int, int] = {}
    try:
        t0 = time.monotonic()
        calls = call_on_ranks(inc, group_replay.recorded_groups, ranks=[donor])[donor]
        bad = group_replay.unreplayable(calls, set(dead))
        if bad:
            raise RuntimeError(f"{'; '.join(bad)} can't be re-formed with a new member (only groups made "
                               f"without backend= are); {inc.restart_hint}")
        generation = begin_reform(inc, survivors)
        if inc.ended:  # the last survivor died meanwhile: nothing is left to heal from
            raise SessionLostError(inc.lost_reason or "the session was closed")
        hellos = _start_replacements(inc, dead, calls, generation, started)
        report.seconds["start"] = time.monotonic() - t0
        t1 = time.monotonic()
        _reform_with_replacements(inc, generation, hellos, dead)
        report.seconds["reform"] = time.monotonic() - t1
        t2 = time.monotonic()
        _copy_namespace(inc, report, survivors)
        report.seconds["copy"] = time.monotonic() - t2
        _end_healed(inc, dead)
    except BaseException as exc:
        _undo(inc, dead, started, exc)
        if inc.lost_reason is not None and not isinstance(exc, SessionLostError):
            raise SessionLostError(inc.lost_reason) from exc  # what every later cell says too
        if started and isinstance(exc, Exception) and inc.life.state == "degraded":  # the cause, then what now
            # A replacement's death is the root cause, whatever the survivors then raised
            cause = "; ".join(f"rank {r}'s replacement died: {f.describe()}"
                              for r, f in sorted(inc.replacements_dead.items())) or exc
            raise RuntimeError(f"the heal of {format_rank_set(dead)} failed and was undone: {cause}\n"
                               f"the session is degraded ({describe_gone(inc.gone)}); {inc.heal_hint} "
                               f"(again); {inc.restart_hint}") from exc
        raise
    # For the export: a job replaying a later stopped cell issues the collectives the rebuilt reducers do.
    inc.history.add(CellRecord(inc.cells_sent, sorted(inc.pids), True, what="heal", status="finished",
                               source=f"{format_rank_set(dead)} from rank {donor}"))
    tell_untold_deaths(inc)  # the donor, say, died after it gave its names
    return report


def _end_healed(inc, dead: list[int]) -> None:
    """The dead ranks are ranks again, and the session idle; unless a replacement died since the
    heal's last call (nothing waited on it then), which fails the heal (it undoes)."""
    with inc.lock:
        died = sorted(inc.replacements_dead)
        if not died:
            for rank in dead:
                inc.gone.pop(rank, None)
                inc.gone_told.discard(rank)
            inc.sources_held = set()  # the new rank holds no notebook source yet: the next cell sends them
            inc.life.move("idle", only_from=("healing",))
    if died:
        raise RuntimeError(f"{format_rank_set(died)}'s replacement died at the end of the heal")


def _start_replacements(inc, dead: list[int], calls: list, generation: int, started: dict) -> dict:
    """Each dead rank started again, told the donor's groups and where to say hello; returns a dict
    the hellos fill in (on a thread: they come once the new ranks joined the groups)."""
    listener = RankListener(inc.address[0], read_session_key(inc.run_dir), len(dead))
    heal_file = os.path.join(inc.run_dir, f"heal-{generation}.pkl")
    rundir.write_private(heal_file, pickle.dumps({"groups": calls, "address": list(listener.address)}))
    hellos: dict = {}

    def accept() -> None:
        deadline = time.monotonic() + HEAL_CONNECT_S + 30
        # Until a replacement dies: its hello never comes (its death may land between the groups'
        # re-forming and the hello, where no call of the kernel's waits on it to fail).
        listener.accept_all(len(dead), deadline, lambda h: hellos.__setitem__(h.rank, h),
                            lambda: inc.life.state == "healing" and not any(map(inc.rank_run.rank_ended, dead)))
        listener.close()

    env = {HEAL_GENERATION_ENV: str(generation), HEAL_FILE_ENV: heal_file}
    try:
        for rank in dead:
            started[rank] = inc.rank_run.replace_rank(rank, env)
    except BaseException:
        listener.close()
        raise
    # Accepting once they run (their hellos wait in the listener's backlog till then): a dead
    # rank's replacement that ended is one whose hello will never come.
    hellos["_thread"] = threading.Thread(target=accept, name="nbdist-heal-accept", daemon=True)
    hellos["_thread"].start()
    return hellos


def _reform_with_replacements(inc, generation: int, hellos: dict, dead: list[int]) -> None:
    """The survivors re-form every group (and reset their DDP reducers) while the new ranks join."""
    from nbdist.worker.session_loop import reform_groups

    # A peer that dies meanwhile leaves the others in gloo's connect: its own deadline frees them
    # (an error, so the heal undoes) before the kernel's, which would end the session.
    inc.last_reform = call_on_ranks(inc, reform_groups, generation, HEAL_CONNECT_S - 30, timeout=HEAL_CONNECT_S)
    thread = hellos.pop("_thread")
    thread.join(30)
    missing = [r for r in dead if r not in hellos]
    ended = [r for r in missing if inc.rank_run.rank_ended(r)]
    if ended:
        raise RuntimeError(f"{format_rank_set(ended)}'s replacement died after it joined the groups")
    if missing:
        raise RuntimeError(f"{format_rank_set(missing)} joined the groups but never said hello to the kernel")
    for rank in dead:
        inc.add_rank(hellos[rank])


def _every_rank_cells(inc) -> tuple[list[str], list[str]]:
    """The files of the cells that ran to their end on every rank, and the names such cells took
    from the notebook: what they defined is alike on every rank, with no survivor to compare."""
    files, names = [], []
    for record in inc.history.records():
        if record.every_rank and record.status == "finished":
            if record.what == "code":
                files.append(os.path.join(inc.run_dir, "cells", f"{record.number:04d}", "cell.py"))
            names += record.notebook_values + record.value_names
    return files, names


def _copy_namespace(inc, report: HealReport, survivors: list[int]) -> None:
    """Copy what every survivor holds alike from the donor; list the rest; say whether the replicas
    are in step (the survivors' fingerprints tell: the new rank's copy is the donor's)."""
    from nbdist.worker import namespace_copy

    # One survivor has nobody to compare its tensors' bytes with: their dtype and shape do.
    prints = call_on_ranks(inc, namespace_copy.fingerprint_names, len(survivors) > 1, ranks=survivors)
    cells, values = _every_rank_cells(inc)
    known = call_on_ranks(inc, namespace_copy.replicated_names, cells, values, ranks=[report.donor])[report.donor]
    names, groups = _judge(prints, report)
    if len(survivors) == 1:  # nothing to compare: only what nbdist knows is replicated
        report.not_judged = sorted(set(names) - set(known))
        names = [n for n in names if n in known]
    # DDP models and their optimizers are copied even where the survivors differ: a death in the
    # middle of a step leaves them apart, and %dist_sync is the way back, not a model left out.
    apart = sorted(n for n in report.rank_specific if n in known)
    report.rank_specific = [n for n in report.rank_specific if n not in known]
    names = sorted(set(names) | set(apart))
    exported, sent = call_on_ranks(inc, namespace_copy.export_names, names, groups,
                                   ranks=[report.donor], as_sent=True)[report.donor]
    report.unpicklable.update(exported["unpicklable"])
    # The tensors' bytes: written once by the donor into its memfds (pickle-5 buffers), which the
    # kernel opens and hands on to the new ranks to map: no second copy, no file, no socket. The
    # donor lets go of its own at the kernel's next message; the kernel's descriptors keep them.
    try:
        shared = reshare(sent) if sent is not None else None
    except OSError:  # the donor died since it answered: its memory is still mapped here, copied once more
        shared = None
    if shared is None:
        shared = dump_shared(exported, "the heal's copy of the donor's names", local=True)
    try:
        call_on_ranks(inc, namespace_copy.import_shared_names, shared, ranks=report.healed)
    finally:
        shared.close()
    call_on_ranks(inc, namespace_copy.rebuild_ddp_reducers)  # every rank alike: one bucket order
    report.copied = sorted(set(names) - set(report.unpicklable))
    if apart:
        report.replicas = (f"the survivors' replicas of {', '.join(apart)} differ (a death in the middle of a step): "
                           f"the new {'rank has' if len(report.healed) == 1 else 'ranks have'} rank {report.donor}'s; "
                           f"%dist_sync re-syncs every rank from one (--from R; Session.sync() in code)")


def _judge(prints: dict[int, dict], report: HealReport) -> tuple[list[str], dict[str, int]]:
    """The names every survivor holds with the same fingerprint, and the group handles among them
    (``{name: k}``: the k-th group call, whose handle each rank has its own of); the others go
    into the report."""
    from nbdist.worker.group_replay import NOT_A_MEMBER

    every = set.intersection(*(set(p) for p in prints.values()))
    report.partial = sorted(set.union(*(set(p) for p in prints.values())) - every)
    same, differ, groups = [], [], {}
    for name in sorted(every):
        values = {p[name] for p in prints.values()}
        made = {v for v in values if v.startswith("process group #")}
        if len(made) == 1 and values <= made | {NOT_A_MEMBER}:  # members hold it, the others torch's stand-in
            groups[name] = int(next(iter(made)).rsplit("#", 1)[1])
            same.append(name)
        elif len(values) > 1:
            differ.append(name)
        elif next(iter(values)).startswith("unpicklable: "):
            report.unpicklable[name] = next(iter(values))[len("unpicklable: "):]
        else:
            same.append(name)
    report.rank_specific = differ
    return same, groups


def _undo(inc, dead: list[int], started: dict[int, int], exc: BaseException) -> None:
    """A heal that failed: stop the replacements, tell the survivors again what their groups lack,
    and stay degraded (or, if that fails too, lost, saying why)."""
    import contextlib
    import signal

    for rank, pid in started.items():
        inc.remove_rank(rank)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # its own group (setsid) is all it is
    reaped = time.monotonic() + REAP_WAIT_S
    slow = [r for r in started if not inc.rank_run.await_rank_end(r, reaped)]
    if slow:  # a SIGKILLed process not reaped in seconds: the kernel can't account for its ranks
        inc.lose(f"the session was stopped: the heal failed ({type(exc).__name__}: {exc}), and "
                 f"{format_rank_set(slow)}'s replacement did not end within {REAP_WAIT_S:g} s of a SIGKILL; "
                 f"{inc.restart_hint}")
        return
    if inc.ended:
        return
    if not inc.pids:  # the last survivor died under the heal: no state is left to keep
        inc.lose(f"the session was lost: every rank died: {describe_gone(inc.gone)}; its state is gone; "
                 f"{inc.restart_hint}")
        return
    with inc.lock:
        if not inc.life.move("recovering", only_from=("healing",)):
            return
    # A survivor that dies meanwhile starts it over on who is left, as for a death while idle
    degrade_until_told(inc, f"the heal failed ({type(exc).__name__}: {exc}), and then")
