"""An incarnation's reply reader: the one thread that reads every rank's answers, for as long as it lives.

No polling: it blocks until a rank writes or goes away. Whatever one reply does, the reader goes on
(or ends the incarnation, saying why): a cell never hangs on nbdist's own bug. A rank that the heal
started joins the ranks it reads when :class:`ReaderWake` is woken (the heal adds its connection).
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Pipe, wait

from nbdist.errors import format_rank_set
from nbdist.session.peers import tell_world_gone
from nbdist.session.recovery import release_if_asked

__all__ = ["read_replies", "ReaderWake", "tell_ranks_gone"]

log = logging.getLogger(__name__)


class ReaderWake:
    """A pipe among the connections the reader waits on: written when the ranks' connections changed."""

    def __init__(self):
        self.reader, self._writer = Pipe(duplex=False)

    def wake(self) -> None:
        try:
            self._writer.send_bytes(b"!")
        except OSError:  # the incarnation ended and the reader with it
            pass

    def drain(self) -> None:
        while self.reader.poll():
            self.reader.recv_bytes()


def read_replies(inc) -> None:
    """Read ``inc``'s ranks' replies until it ends (or no rank is left to read)."""
    # conn -> rank, keyed by the connection itself: an ended rank's connection, once freed, may lend
    # its id() to the healed rank's, which a dict of ids then took for one it already read (the
    # heal's first call to the new rank waited out its deadline: soak seed 446660353).
    ranks: dict = {}
    live: list = []

    def take_new_ranks() -> None:
        current = list(inc.conns.items())
        held = [conn for _, conn in current]
        for conn in [c for c in ranks if c not in live and c not in held]:
            del ranks[conn]  # read to its end, and no longer the session's: never taken again
        for rank, conn in current:
            if conn not in ranks:
                ranks[conn] = rank
                live.append(conn)

    take_new_ranks()
    while live and not inc.ended:
        try:
            ready = wait(live + [inc.reader_wake.reader])
        except (OSError, ValueError):  # a channel closed here meanwhile (a heal undone): never read again
            if inc.reader_wake.reader.closed:
                return
            live[:] = [c for c in live if not c.closed]
            continue
        closed = []
        for conn in ready:
            if conn is inc.reader_wake.reader:
                inc.reader_wake.drain()
                take_new_ranks()
                continue
            rank = ranks[conn]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                live.remove(conn)  # that rank exited: the session run's monitor says why
                if inc.conns.get(rank, conn) is conn:  # (else a heal already brought the rank back)
                    closed.append(rank)
                continue
            except Exception as exc:  # a message that can't be read: this rank's channel is not to be trusted
                live.remove(conn)
                inc.lose(f"the session was stopped: a message from rank {rank} could not be read "
                         f"({type(exc).__name__}: {exc}); its state is lost; {inc.restart_hint}")
                continue
            try:
                on_reply(inc, rank, message)
            except Exception as exc:  # nbdist's own bug: never a cell that waits for ever
                log.exception("nbdist: handling rank %s's reply failed", rank)
                inc.lose(f"the session was stopped: nbdist failed on rank {rank}'s reply "
                         f"({type(exc).__name__}: {exc}); its state is lost; {inc.restart_hint}")
        if closed:
            tell_ranks_gone(inc, closed)


def tell_ranks_gone(inc, closed: list[int]) -> None:
    """Ranks whose channels closed in one look: the run learns when, and the other nodes hear it now
    (their sockets close before the monitor sees the exits). An engine takes a failed rank's peers
    down within its own tick: a reader slower than that finds them closed together, and names them
    all, as it can't tell which went first."""
    for rank in closed:
        inc.rank_run.saw_rank_go(rank)
    first = inc.rank_run.first_gone() or closed
    tell_world_gone(inc, f"was lost ({format_rank_set(first)} ended)")


def on_reply(inc, rank: int, message) -> None:
    """One message of rank ``rank``: a display, the debugger, or its part of the cell done."""
    cell = inc.active
    if cell is None or message[2] != cell.cell_id:
        return
    if message[0] == "display":
        cell.feed_display(rank, message[3], message[4])
        return
    if message[0] in ("debug", "debug_resumed"):
        cell.on_debug_message(rank, message)
        return
    _, _, _, kind, body, offsets, watched = message
    if watched:
        inc.watched_files.note(rank, watched)
    last = cell.record_done(rank, kind, body, offsets, inc.pids.get(rank))
    release_if_asked(inc, cell, rank)
    if last:
        inc.settle(cell)
    elif (kind == "failed" or (kind == "interrupted" and not cell.stop_requested)) and not cell.internal:
        # Its peers may wait for it in a collective (it raised, or raised KeyboardInterrupt by
        # itself): release them as the stop button would.
        inc.release_peers_of(cell)
