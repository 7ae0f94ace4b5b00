"""nbdist's own calls on a session's ranks, while it brings them in step or heals them.

An internal cell: the function goes to the ranks as a user's cell would, but the incarnation is
"recovering" or "healing", and a rank that doesn't answer within the deadline ends the session,
saying where it stood (never a wait without end).
"""

from __future__ import annotations

from nbdist.errors import SessionLostError, format_rank_set
from nbdist.protocol import rundir

__all__ = ["call_on_ranks", "CHECK_TIMEOUT_S"]

CHECK_TIMEOUT_S = 60.0  # counting collectives takes ms; re-forming waits for every rank to connect


def call_on_ranks(inc, fn, *args, timeout: float = CHECK_TIMEOUT_S, ranks=None, as_sent: bool = False) -> dict:
    """Run nbdist's own ``fn(*args)`` on every rank (or ``ranks``) of a session that is bringing its
    ranks in step, or healing.

    Returns ``{rank: value}`` (with ``as_sent``, ``{rank: (value, shared)}``: ``shared`` the
    :class:`~nbdist.protocol.shared_values.SharedValue` it came in, None when it came in-band); a rank that doesn't answer within ``timeout`` is dumped and the
    session is stopped (SessionLostError); a rank that raised raises its WorkerFailedError.
    """
    gone = sorted(set(ranks or ()) - set(inc.conns))
    if gone:  # died since the caller chose them (the heal's donor, say)
        raise RuntimeError(f"{format_rank_set(gone)} died meanwhile")
    if ranks is None and not inc.pids or ranks is not None and not ranks:
        raise RuntimeError("no rank is left to call")  # a cell with no targets would never answer
    cell_dir = inc.new_cell_dir()
    payload, _ = rundir.pack_payload(fn, args, {})
    handle = inc.start_cell(cell_dir, sorted(inc.pids) if ranks is None else list(ranks), payload, None,
                            internal=True)
    if not handle.answered.wait(timeout):
        stuck = handle.busy_ranks()
        where = inc.dump_stacks(stuck) if stuck else ""
        if handle.deaths:  # what the stuck ones may have waited for: the kernel saw it die
            where += f" ({format_rank_set(sorted(handle.deaths))} died during it)"
        inc.lose(f"the session was stopped: {format_rank_set(stuck)} did not answer within {timeout:g} s "
                 f"while the session brought its ranks back in step{where}; the state is lost; {inc.restart_hint}")
        raise SessionLostError(inc.lost_reason)
    handle._done.wait(timeout)
    if handle.error is not None:
        raise handle.error
    if as_sent:
        return {r: (v, handle.shared_replies.get(r)) for r, v in handle.results.items()}
    return handle.results
