"""Bringing a session's ranks back in step after a cell that failed or was interrupted.

When a cell ends abnormally, some ranks may have left a collective that their peers issued, or
been freed from one by their peers dropping their connections (:meth:`Session.interrupt_cell`).
Either way the next collective could hang or sum the wrong tensors. So before the cell says it
is done, the session counts each rank's collectives per group; if a rank was freed or the counts
differ, every rank re-forms its groups *in place* (:mod:`nbdist.worker.reformable_groups`): DDP models, FSDP2
meshes and the user's own group handles keep the objects they hold, now connected again. A group
that can't be re-formed (a backend nbdist doesn't wrap) stops the inc, said in one line, so
the user never meets it as a hang or a wrong sum.
"""

from __future__ import annotations

import contextlib
import os
import signal

from nbdist.errors import SessionLostError, format_rank_set
from nbdist.protocol import rundir
from nbdist.protocol.session_channel import CUT_REQUEST, STOP_REQUEST
from nbdist.protocol.signals import CUT_SIGNAL
from nbdist.session.agreed_stop import agree_stop_point, await_stop_point
from nbdist.session.internal_calls import CHECK_TIMEOUT_S, call_on_ranks
from nbdist.session.collectives import ask_open_collectives, describe_open_collectives
from nbdist.session.peers import announce_stop
from nbdist.session.rank_deaths import MAX_DEATHS_WHILE_RECOVERING, begin_reform, degrade_survivors, heal_at_once
from nbdist.session.replica_check import describe_drift
from nbdist.worker.session_loop import count_collectives, reform_groups, reset_models

__all__ = ["stop_cell", "interrupt_ranks", "release_if_asked", "recover", "bring_in_step", "RELEASE_AFTER_S",
           "RELEASE_AFTER_PEER_FAILED_S", "STUCK_AFTER_S", "catch_up"]

# A rank in Python answers SIGINT within milliseconds; one still busy after this waits in C code,
# most likely a collective that a peer left: the free ranks then drop their connections.
RELEASE_AFTER_S = 0.5
# After a peer raised, its peers are released sooner: the error must show within about 2 s.
RELEASE_AFTER_PEER_FAILED_S = 0.3
STUCK_AFTER_S = 3.0  # a rank still busy this long after the release is stuck for good (C code)


def stop_cell(inc, cell, release_after: float = RELEASE_AFTER_S) -> None:
    """SIGINT to every busy rank (through the OS, not the busy loop). A rank still busy after
    ``release_after`` waits in C code: the free ranks drop their group connections, and the busy
    ones cut their own (:func:`nbdist.worker.session_loop._answer_signals`), which fails the collective
    it waits in; one still busy :data:`STUCK_AFTER_S` later ends the incarnation.

    ``inc`` is the cell's incarnation; once it has ended, nothing is signalled (its pids may
    belong to other processes by now)."""
    if inc.ended or cell.done:
        return
    cell.stop_requested = True
    announce_stop(inc, cell)  # a session across kernels: the other nodes stop their part too
    # Every rank stops before the same collective... unless one died: nothing can complete then.
    cell.agreed = None if cell.deaths else agree_stop_point(inc, cell)
    if cell.agreed is not None and await_stop_point(cell):
        return
    busy = cell.busy_ranks()  # ...but the deadline wins: these are stopped where they are
    if cell.agreed is not None and cell.agreed.window > 0:  # (none: each waits in an op that can't complete)
        cell.stopped_anywhere, cell.behind = list(busy), cell.agreed.behind(busy)
    interrupt_ranks(cell, inc.local_pids(busy))
    if not busy or cell.answered.wait(release_after):
        return
    # Still busy: most likely in a collective. Where each rank is goes into the cell's messages.
    cell.collectives = describe_open_collectives(ask_open_collectives(inc, cell))
    with inc.lock:
        waiting = cell.busy_ranks()
        free = [r for r in sorted(inc.pids) if r not in waiting]
        release = bool(waiting) and not cell.released and inc.status == "busy" and inc.active is cell
        if release:
            cell.released, cell.release_sent = waiting, set(free)
    if release:
        if free:  # and each rank it frees drops its connections in turn (release_if_asked)
            inc.send(free, ("release",))
        if CUT_SIGNAL is not None:  # and a rank with no free peer (all stuck, or in a ring) cuts its own
            rundir.write_private(os.path.join(cell.cell_dir, CUT_REQUEST), b"")  # for this cell only
            for pid in inc.local_pids(waiting):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, CUT_SIGNAL)
    if cell.answered.wait(STUCK_AFTER_S):
        return
    stuck = cell.busy_ranks()
    if not stuck or inc.ended or inc.active is not cell:
        return
    where = inc.dump_stacks(stuck)
    one = len(stuck) == 1
    freed = (f"; cutting {'its' if one else 'their'} process groups' connections did not free "
             f"{'it' if one else 'them'}") if CUT_SIGNAL is not None else ""
    if inc.ranks_elsewhere():
        freed += (f"; the world's {format_rank_set(inc.ranks_elsewhere())} are driven by other kernels, "
                  f"whose cell may have ended without this collective")
    inc.lose(f"the session was stopped: {format_rank_set(stuck)} could not be brought back within "
             f"{release_after + STUCK_AFTER_S:g} s (stuck in C code{where}{freed}"
             f"{'; ' + cell.collectives if cell.collectives else ''}); "
             f"their state is lost; {inc.restart_hint}")


def interrupt_ranks(cell, pids) -> None:
    """SIGINT, for ``cell`` only, to the ranks ``pids`` (of this machine: a rank on another machine
    can't be signalled from here). The request in the cell's dir comes first, so that a rank that
    gets the signal only once the cell is over ignores it."""
    with contextlib.suppress(OSError):  # a cell dir that is gone: the cell is long over
        rundir.write_private(os.path.join(cell.cell_dir, STOP_REQUEST), b"")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)


def release_if_asked(inc, cell, rank: int) -> None:
    """A rank freed by the release drops its own connections too: in a ring, a rank may wait on
    a peer that was itself waiting (not on the rank that left), and only this frees it."""
    with inc.lock:
        if not cell.released or rank in cell.release_sent:
            return
        cell.release_sent.add(rank)
    inc.send([rank], ("release",))


def recover(inc, cell) -> None:
    """After a failed or interrupted cell (on a thread of its own: bringing the ranks in step needs
    the reply reader): check every group, re-form in place if needed, then end the cell."""
    for _ in range(1 + MAX_DEATHS_WHILE_RECOVERING):
        try:
            cell.note = bring_in_step(inc, cell)
            break
        except SessionLostError as exc:
            cell.lose(exc)
            return
        except Exception as exc:  # the ranks couldn't be checked: nothing may run on them now
            if inc.ended:  # it ended under us (a rank died, or it was closed): that says why
                cell.lose(SessionLostError(inc.lost_reason or "the session was closed", inc.rank_run.error))
                return
            if set(inc.gone) - inc.gone_told:
                continue  # a rank died while they were brought in step: again, on the survivors
            kind = "failed" if cell.failures else "interrupted"
            inc.lose(f"the session was stopped: its ranks could not be brought back in step after the {kind} "
                     f"cell ({type(exc).__name__}: {exc}); the state is lost; {inc.restart_hint}")
            cell.lose(SessionLostError(inc.lost_reason))
            return
    else:
        inc.lose(f"the session was stopped: ranks kept dying while the survivors were brought in step; "
                 f"the state is lost; {inc.restart_hint}")
        cell.lose(SessionLostError(inc.lost_reason))
        return
    if inc.gone and inc.heal_mode == "auto":  # Session(heal="auto"): this cell says how the heal went
        with inc.lock:
            inc.life.move("degraded", only_from=("recovering",))
        cell.note = f"{cell.note}; {heal_at_once(inc)}" if cell.note else heal_at_once(inc)
    inc.become_idle(cell)


def _why(inc, cell, counts: dict) -> str:
    """What left the ranks out of step, in the words of the cell's note (with where each rank
    waited, when their flight recorders said)."""
    where = f"; where each rank waited: {cell.collectives}" if cell.collectives else ""
    return _why_out_of_step(inc, cell, counts) + where


def _why_out_of_step(inc, cell, counts: dict) -> str:
    if cell.released and set(cell.released) >= set(inc.pids):
        return (f"{format_rank_set(cell.released)} waited in collectives that could not complete, and were released, "
                f"each cutting its own connections")
    if cell.released:
        one = len(cell.released) == 1
        return (f"{format_rank_set(cell.released)} waited in a collective that {'its' if one else 'their'} peers "
                f"had left, and {'was' if one else 'were'} released")
    first = next(iter(next(iter(counts.values()))), None)  # the default group: made first
    where = ", ".join(f"rank {r} after {c.get(first)}" for r, c in sorted(counts.items()))
    return f"the ranks stopped at different collectives ({where})"


def bring_in_step(inc, cell) -> str | None:
    """Check the ranks' groups after ``cell``; re-form them in place if needed.

    Returns the note for the cell's output (None when nothing had to be done). Raises
    SessionLostError when the groups are out of step and can't be re-formed.
    """
    if inc.gone:  # the survivors of a death: their groups lack the dead ranks until the heal
        return degrade_survivors(inc)
    across = inc.world is not None
    if across:  # every abnormal cell re-forms the world's groups, on every kernel (nbdist.session.peers)
        announce_stop(inc, cell)
        told = lambda: inc.reform_due == inc.generation  # noqa: E731
        with inc.lock:
            if cell.failures and all(f.secondary for f in cell.failures.values()):
                # Its ranks only lost their peers: the node that stopped first says why, within ms.
                inc.told.wait_for(told, timeout=2.0)
            cell.stopped_by = inc.stopped_by if told() else None
    answers = {r: a for r, a in call_on_ranks(inc, count_collectives).items() if a is not None}
    if not answers:
        return None  # no process group: nothing can be out of step
    counts = {r: a[1] for r, a in answers.items()}
    replicas = describe_drift({r: a[3] for r, a in answers.items()}, {r: a[4] for r, a in answers.items()},
                              cell.stopped_anywhere)
    in_step = len({tuple(sorted(c.items())) for c in counts.values()}) == 1
    if in_step and not cell.released and not across:
        if any(a[2] for a in answers.values()):  # a step stopped half-way: the next one would not pair up
            call_on_ranks(inc, reset_models)
            cell.models_reset = True  # an export's replay of the cell resets them too (job_world)
        return replicas or None
    why = _why(inc, cell, counts)
    if across and in_step and not cell.released:
        why = f"as every node's kernel does after a cell that {'failed' if cell.failures else 'was stopped'}"
    kind = "failed" if cell.failures else "interrupted"
    if not all(a[0] for a in answers.values()):
        inc.lose(f"the session was stopped: after the {kind} cell {why}, and its process group "
                 f"(backend {inc.options.backend!r}) can't be re-formed in place, so the next collective "
                 f"could hang or give wrong results; the state is lost; {inc.restart_hint}")
        raise SessionLostError(inc.lost_reason)
    done = call_on_ranks(inc, reform_groups, begin_reform(inc, inc.pids))
    cell.models_reset = True  # the re-forming resets every model
    ms = max(d["seconds"] for d in done.values()) * 1000
    inc.last_reform = done  # the parts' timings, for benchmarks and tests
    where = f" across the {inc.options.nnodes} nodes' kernels" if across else ""
    note = f"the process group was re-formed in place{where} in {ms:.0f} ms"
    note = (f"{cell.stopped_by}; {note}" if cell.stopped_by else f"{note} ({why})") + "; models, optimizers and data are kept"
    return note + ("; " + replicas if replicas else "")


def catch_up(inc) -> None:
    """Idle, this node re-forms the world's groups with the kernel that announced a stop."""
    with inc.lock:
        if not inc.life.move("recovering", only_from=("idle",)):
            return
        inc.in_step.clear()  # a cell sent now waits for the re-forming
    try:
        inc.last_reform = call_on_ranks(inc, reform_groups, begin_reform(inc, inc.pids), timeout=CHECK_TIMEOUT_S)
    except SessionLostError:
        pass  # call_on_ranks stopped the session and said why
    except Exception as exc:
        inc.lose(f"the session was stopped: its ranks could not re-form the world's process group with the "
                 f"other nodes ({type(exc).__name__}: {exc}); the state is lost; {inc.restart_hint} on every node")
    finally:
        inc.life.move("idle", only_from=("recovering",))
        inc.in_step.set()
