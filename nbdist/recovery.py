"""Bringing a session's ranks back in step after a cell that failed or was interrupted.

When a cell ends abnormally, some ranks may have left a collective that their peers issued, or
been freed from one by their peers dropping their connections (:meth:`Session.interrupt_cell`).
Either way the next collective could hang or sum the wrong tensors. So before the cell says it
is done, the session counts each rank's collectives per group; if a rank was freed or the counts
differ, every rank re-forms its groups *in place* (:mod:`nbdist.reform`): DDP models, FSDP2
meshes and the user's own group handles keep the objects they hold, now connected again. A group
that can't be re-formed (a backend nbdist doesn't wrap) stops the session, said in one line, so
the user never meets it as a hang or a wrong sum.
"""

from __future__ import annotations

from . import payload
from .errors import SessionLostError, format_rank_set
from .session_rank import count_collectives, reform_groups, reset_ddp_reducers

__all__ = ["call_on_ranks", "bring_in_step"]

CHECK_TIMEOUT_S = 60.0  # counting collectives takes ms; re-forming waits for every rank to connect


def call_on_ranks(session, fn, *args, timeout: float = CHECK_TIMEOUT_S) -> dict:
    """Run nbdist's own ``fn(*args)`` on every rank of a session that is bringing its ranks in step.

    Returns ``{rank: value}``; a rank that doesn't answer within ``timeout`` is dumped and the
    session is stopped (SessionLostError); a rank that raised raises its WorkerFailedError.
    """
    cell_dir = session.new_cell_dir()
    payload.write_payload(cell_dir, fn, args, {})
    handle = session.start_cell(cell_dir, sorted(session.pids), None, internal=True)
    if not handle.answered.wait(timeout):
        stuck = handle.busy_ranks()
        where = session._dump_stacks(stuck) if stuck else ""
        session._lose(f"the session was stopped: {format_rank_set(stuck)} did not answer within {timeout:g} s "
                      f"while the session brought its ranks back in step{where}; the state is lost; restart() "
                      f"brings new ranks")
        raise SessionLostError(session.lost_reason)
    handle._done.wait(timeout)
    if handle.error is not None:
        raise handle.error
    return handle.results


def _why(cell, counts: dict) -> str:
    """What left the ranks out of step, in the words of the cell's note."""
    if cell.released:
        one = len(cell.released) == 1
        return (f"{format_rank_set(cell.released)} waited in a collective that {'its' if one else 'their'} peers "
                f"had left, and {'was' if one else 'were'} released")
    first = next(iter(next(iter(counts.values()))), None)  # the default group: made first
    where = ", ".join(f"rank {r} after {c.get(first)}" for r, c in sorted(counts.items()))
    return f"the ranks stopped at different collectives ({where})"


def bring_in_step(session, cell) -> str | None:
    """Check the ranks' groups after ``cell``; re-form them in place if needed.

    Returns the note for the cell's output (None when nothing had to be done). Raises
    SessionLostError when the groups are out of step and can't be re-formed.
    """
    answers = {r: a for r, a in call_on_ranks(session, count_collectives).items() if a is not None}
    if not answers:
        return None  # no process group: nothing can be out of step
    counts = {r: a[1] for r, a in answers.items()}
    replicas = _replicas_note({r: a[3] for r, a in answers.items()})
    in_step = len({tuple(sorted(c.items())) for c in counts.values()}) == 1
    if in_step and not cell.released:
        if any(a[2] for a in answers.values()):  # a backward stopped half-way: DDP's next step would fail
            call_on_ranks(session, reset_ddp_reducers)
        return replicas or None
    why = _why(cell, counts)
    kind = "failed" if cell.failures else "interrupted"
    if not all(a[0] for a in answers.values()):
        session._lose(f"the session was stopped: after the {kind} cell {why}, and its process group "
                      f"(backend {session.options.backend!r}) can't be re-formed in place, so the next collective "
                      f"could hang or give wrong results; the state is lost; restart() brings new ranks")
        raise SessionLostError(session.lost_reason)
    session._generation += 1
    done = call_on_ranks(session, reform_groups, session._generation)
    ms = max(d["seconds"] for d in done.values()) * 1000
    session.last_reform = done  # the parts' timings, for benchmarks and tests
    note = f"the process group was re-formed in place in {ms:.0f} ms ({why}); models, optimizers and data are kept"
    return note + ("; " + replicas if replicas else "")


def _replicas_note(prints: dict) -> str:
    """DDP replicas that differ now (a rank took an optimizer step its peers did not): say which."""
    models = max((len(p) for p in prints.values()), default=0)
    differ = [i for i in range(models) if len({p[i] if i < len(p) else None for p in prints.values()}) > 1]
    if not differ:
        return ""
    which = ", ".join(f"#{i + 1}" for i in differ)
    return (f"the replicas of DDP model {which} (in the order the cells built them) now differ between ranks, "
            f"which stopped at different steps: re-sync them from rank 0 before training on "
            f"(for p in model.parameters(): dist.broadcast(p.data, src=0))")
