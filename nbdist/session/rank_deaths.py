"""A rank of a session died: the survivors keep their state, and the session is degraded until the heal.

For ranks that nbdist starts itself (spawn, and forks of the warm template) the session run keeps
its survivors (:attr:`nbdist.run.state.Run.keep_survivors`): the run's monitor reaps the dead rank
(and clears its process group) and tells the incarnation through the rank's event, instead of
stopping the tree. What happens then depends on what the incarnation was doing:

* idle (or degraded already): the survivors' groups are told which members they lack
  (:func:`nbdist.worker.reformable_groups.degrade_groups`), on the survivors only;
* busy: the dead rank's part of the cell fails with how it died, the survivors are freed from
  whatever collective they wait in (as a raising rank's peers are), and the cell's recovery then
  degrades the groups instead of re-forming them;
* bringing its ranks in step: the internal call fails, and the recovery starts over on the survivors.

Then the session is "degraded": a cell that needs a dead rank is refused in one line
(:class:`nbdist.errors.RankGoneError`), a cell on the survivors runs, and a collective on a group
that lacks a member fails at once naming it. A session whose every rank died is lost, as before:
the run ends, and :meth:`Incarnation.on_run_event` says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass

from nbdist.errors import RankFailure, RankGoneError, format_rank_set
from nbdist.protocol.session_channel import REFORM_CALLED_OFF_FILE
from nbdist.session.internal_calls import call_on_ranks

__all__ = ["RankGone", "note_rank_death", "degrade_survivors", "refuse_for_gone", "describe_gone",
           "heal_at_once", "tell_untold_deaths", "degrade_until_told", "dead_targets", "begin_reform", "LAST_LINES",
           "MAX_DEATHS_WHILE_RECOVERING"]

log = logging.getLogger(__name__)
MAX_DEATHS_WHILE_RECOVERING = 4  # each one starts the recovery over on the survivors; then it gives up
# Survivors re-form their whole groups in well under a second; a member that dies meanwhile leaves
# the others in gloo's connect until this, then the session degrades again without it.
DEGRADE_CONNECT_S = 10.0
SETTLE_S = 0.2  # ranks that die together (a node's OOM killer) are seen within this: told at once
LAST_LINES = 3  # of the dead rank's log, in the cell's error and in the session's repr


@dataclass(frozen=True)
class RankGone:
    """One dead rank of a session: how it died, and the last lines it wrote."""

    rank: int
    pid: int | None
    exitcode: int | None
    signal_name: str | None
    at: float  # time.time() it was seen gone
    last_lines: tuple[str, ...] = ()

    def how(self) -> str:
        """``"was killed by SIGKILL (pid 123)"``, ``"exited with code 3 (pid 123)"``."""
        if self.signal_name:
            what = f"was killed by {self.signal_name}"
        else:
            what = f"exited with code {self.exitcode}"
        return f"{what} (pid {self.pid})"

    def as_failure(self) -> RankFailure:
        """Its part of the cell that saw it die (the root cause: never a secondary failure)."""
        said = "; its last lines: " + " | ".join(self.last_lines) if self.last_lines else ""
        return RankFailure(rank=self.rank, pid=self.pid, exitcode=self.exitcode, signal_name=self.signal_name,
                           message=f"died during the cell{said}", time=self.at)


def describe_gone(gone: dict[int, RankGone]) -> str:
    """``"rank 2 was killed by SIGKILL (pid 123)"``, one clause per dead rank."""
    return "; ".join(f"rank {r} {g.how()}" for r, g in sorted(gone.items()))


def _last_lines(run, grank: int) -> tuple[str, ...]:
    run.pump_output()  # what it wrote as it died
    for local, out in run.outputs.items():
        if run.global_rank(local) == grank:
            return tuple(line.rstrip() for _, line in list(out.lines)[-LAST_LINES:])
    return ()


def note_rank_death(inc, rank: int, status) -> None:
    """The run's monitor saw rank ``rank`` die (``status``: its RankStatus). Keep the survivors: on a
    thread of its own, as degrading the groups runs an internal cell on them, whose replies the
    reader thread must read."""
    with inc.lock:
        if inc.ended:
            return
        if rank in inc.gone and inc.life.state == "healing":  # its replacement died: the heal fails, now
            _call_off_reform(inc, inc.life.generation, f"rank {rank}'s replacement died (pid {status.pid})")
            _fail_heal_call(inc, rank, status)
            return
        if rank in inc.gone or rank not in inc.pids:
            return
        gone = RankGone(rank, status.pid or inc.pids.get(rank), status.exitcode, status.signal_name, time.time(),
                        _last_lines(inc.rank_run, rank))
        if inc.reforming is not None and rank in inc.reforming[1]:  # its peers may wait for it there
            _call_off_reform(inc, inc.reforming[0], f"rank {rank} {gone.how()}")
        inc.gone[rank] = gone
        inc.pids.pop(rank)  # never signalled again: its pid may be another process's soon
        inc.conns.pop(rank, None)  # never written to again
        cell = inc.active
        state = inc.life.state
        if not inc.pids and state != "healing":
            return  # every rank died: the run ends by itself, and the session is lost (on_run_event)
        # (The last survivor dying mid-heal leaves only replacements, which keep the run alive: the
        # heal's call must fail now, so that the heal undoes and the session is lost at once.)
    if state in ("busy", "recovering", "healing") and cell is not None:
        recorded = cell.record_death(gone.as_failure())
        if recorded:
            inc.settle(cell)  # the dead rank was the last to answer (an internal call: it fails, and
            # the recovery starts over on the survivors)
        elif recorded is False and not cell.internal:
            inc.release_peers_of(cell)  # they may wait for it in a collective: as for a rank that raised
        return  # a cell without it goes on; its end degrades the groups (Incarnation.settle)
    if state in ("idle", "degraded"):
        threading.Thread(target=degrade_when_idle, args=(inc,), name="nbdist-rank-death", daemon=True).start()


def _fail_heal_call(inc, rank: int, status) -> None:
    """The heal's replacement for ``rank`` died: the call it was part of fails (the heal then undoes),
    and so does every later call of the heal's on it (it may have died between two, under inc.lock)."""
    failure = RankFailure(rank=rank, pid=status.pid, exitcode=status.exitcode, signal_name=status.signal_name,
                          message="its replacement died during the heal", time=time.time())
    inc.replacements_dead[rank] = failure
    cell = inc.active
    if cell is None or not cell.internal:
        return
    if cell.record_death(failure):
        threading.Thread(target=inc.settle, args=(cell,), daemon=True).start()


def dead_targets(inc, targets) -> dict:
    """Under inc.lock: ``{rank: RankFailure}`` of an internal call's ``targets`` that died before it
    began (a caller chose them, then one died), the heal's replacements that died included: the
    call fails on them at once, as on a rank that dies during it."""
    dead = {r: g.as_failure() for r, g in inc.gone.items() if r in targets and r not in inc.conns}
    if inc.life.state == "healing":
        dead.update((r, f) for r, f in inc.replacements_dead.items() if r in targets)
    return dead


def begin_reform(inc, needed) -> int:
    """The generation the ranks re-form their groups to, the ranks ``needed`` there remembered: the
    death of one calls the re-forming off at once, so that its peers stop waiting for it
    (:mod:`nbdist.worker.member_arrival`) instead of waiting out gloo's connect; one dead already
    (between the caller's look and now) calls it off before it begins."""
    with inc.lock:
        generation = inc.life.next_generation()
        inc.reforming = (generation, frozenset(needed))
        dead = sorted(set(needed) - set(inc.pids))
    if dead:
        _call_off_reform(inc, generation, f"{format_rank_set(dead)} died before it began")
    return generation


def _call_off_reform(inc, generation: int, why: str) -> None:
    """Tell the ranks waiting for their peers under ``generation`` to stop: ``why``, in a file they poll."""
    path = os.path.join(inc.run_dir, REFORM_CALLED_OFF_FILE.format(generation=generation))
    # The first reason stays, with its time (the file's): later deaths are its consequences. A
    # member that reads the file before the reason is in says "a member died" (member_arrival).
    with contextlib.suppress(OSError):  # there already, or the run dir is gone (so are the ranks)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(why.encode())


def tell_untold_deaths(inc) -> None:
    """Idle (or degraded) again after a cell or a heal: a rank that died meanwhile, whose death no
    call was waiting on, is told to the survivors now."""
    if not inc.ended and set(inc.gone) - inc.gone_told and inc.pids:
        threading.Thread(target=degrade_when_idle, args=(inc,), name="nbdist-rank-death", daemon=True).start()


def degrade_when_idle(inc) -> None:
    """An idle session lost a rank: its survivors' groups learn which members they lack."""
    time.sleep(SETTLE_S)
    with inc.lock:
        if not inc.life.move("recovering", only_from=("idle", "degraded")):
            return  # busy meanwhile (the cell's end degrades), or ended
    if not degrade_until_told(inc, f"after {describe_gone(inc.gone)},"):
        return
    if inc.heal_mode == "auto":  # no cell to say it: Session.last_heal holds it, and the log
        log.warning("nbdist: %s", heal_at_once(inc))


def degrade_until_told(inc, after: str) -> bool:
    """A recovering session's survivors told what their groups lack (:func:`degrade_survivors`),
    again on who is left while ranks keep dying (two at once); then degraded, and True. Else the
    session is lost, saying why: ``after`` is what came before, in words (``"after rank 2 ...,"``)."""
    from nbdist.errors import SessionLostError

    for _ in range(1 + MAX_DEATHS_WHILE_RECOVERING):
        try:
            degrade_survivors(inc)
            break
        except SessionLostError:
            return False  # the session was stopped, saying why
        except Exception as exc:
            if not inc.ended and inc.pids and set(inc.gone) - inc.gone_told:
                continue  # another rank died meanwhile: again, on who is left
            inc.lose(f"the session was stopped: {after} its survivors could not be told "
                     f"({type(exc).__name__}: {exc}); the state is lost; {inc.restart_hint}")
            return False
    else:
        inc.lose(f"the session was stopped: ranks kept dying ({describe_gone(inc.gone)}); {inc.restart_hint}")
        return False
    if not inc.life.move("degraded", only_from=("recovering",)):
        return False  # closed meanwhile
    tell_untold_deaths(inc)  # one that died once the call had answered: no call saw it
    return True


def heal_at_once(inc) -> str:
    """``heal="auto"``: heal now; what happened, in words for the cell that saw the death."""
    try:
        inc.last_heal = inc.heal()
    except Exception as exc:  # noqa: BLE001 - said, and the session stays degraded
        inc.last_heal = exc
        return f"the heal (--heal auto) failed: {exc}"
    return f"--heal auto: {inc.last_heal}"


def degrade_survivors(inc) -> str:
    """On every survivor: the groups that held a dead rank lack it (their collectives fail at once,
    naming it), the others are re-formed among their members. Returns the cell's note."""
    from nbdist.worker.session_loop import degrade_groups

    gone = dict(inc.gone)
    told = {r: g.how() for r, g in gone.items()}
    answers = call_on_ranks(inc, degrade_groups, told, begin_reform(inc, inc.pids), DEGRADE_CONNECT_S)
    inc.gone_told = set(gone)
    survivors = format_rank_set(sorted(inc.pids))
    lacking = any(a and a["lacking"] for a in answers.values())
    them = "it" if len(gone) == 1 else "them"
    groups = f"; their process groups lack {them} (a collective fails at once, naming {them})" if lacking else ""
    keep = "keeps its" if len(inc.pids) == 1 else "keep their"
    return f"{describe_gone(gone)}: {survivors} {keep} state{groups}; {inc.heal_hint}; {inc.restart_hint}"


def refuse_for_gone(inc, targets) -> None:
    """Raise :class:`RankGoneError` when ``targets`` holds a dead rank: one line, nothing runs."""
    dead = {r: g for r, g in inc.gone.items() if r in targets}
    if not dead:
        return
    magic = inc.from_magics
    survivors = sorted(inc.pids)
    raise RankGoneError({r: g.how() for r, g in dead.items()}, survivors,
                        heal="%dist_heal" if magic else "Session.heal()",
                        restart="%dist_restart starts over" if magic else "Session.restart() starts over",
                        subset=(f"a cell with --ranks {','.join(map(str, survivors))}" if magic else
                                f"a call with ranks={survivors}"))
