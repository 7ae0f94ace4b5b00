"""How an incarnation's ranks come up: launched, then each says hello, or the deadline says which never did.

Runs on the incarnation's own start thread (:class:`nbdist.session.incarnation.Incarnation` returns
at once; a cell sent meanwhile waits for :attr:`Incarnation.ready`). Start-or-close: a launch that
fails stops what it started (:func:`nbdist.run.start.start_run`), and ranks that never connect
within the start deadline end the incarnation with the place each of them was stuck in, not a hang.
"""

from __future__ import annotations

import socket
import threading
import time

from nbdist.errors import format_rank_set
from nbdist.protocol import rundir
from nbdist.session.peers import link_kernels
from nbdist.worker.session_loop import serve_session

__all__ = ["bring_up"]


def bring_up(inc, engine) -> None:
    """Start ``inc``'s ranks under ``engine`` and take their hellos; then read their replies for
    as long as the incarnation lives (the thread this runs on becomes its reply reader)."""
    from nbdist.run.start import start_run

    if inc.options.nnodes > 1:  # the link to the other kernels needs torch here: import it meanwhile
        threading.Thread(target=__import__, args=("torch.distributed",), daemon=True).start()
    try:
        inc.rank_run = start_run(serve_session, (inc.run_dir, inc.address), {}, inc.options,
                                 launcher=engine, run_id=inc.session_id, run_dir=inc.run_dir, reformable=True)
    except BaseException as exc:  # start-or-close already stopped what it started
        with inc.lock:
            inc.lost_reason = f"the session could not start: {type(exc).__name__}: {exc}"
            inc.life.end("lost")
        inc.listener.close()
        inc.ready.set()
        return
    finally:
        inc.launched.set()
    inc.rank_run.subscribe(inc.on_run_event)  # replayed: a run that ended already is seen too
    if _accept_ranks(inc, engine):
        inc.read_replies()


def _expected_ranks(inc) -> set[int]:
    return {inc.rank_run.global_rank(r) for r in inc.rank_run.ranks}


def _accept_ranks(inc, engine) -> bool:
    """Take each rank's authenticated hello until all are in or the start deadline passes; True
    when every rank is in and the incarnation is idle."""
    here = socket.gethostname()

    def on_hello(hello) -> None:
        inc.conns[hello.rank], inc.pids[hello.rank] = hello.conn, hello.pid
        if hello.host != here:  # a pid of another machine: never one to signal here
            inc.remote.add(hello.rank)

    deadline = inc.started_at + inc.start_timeout
    arrived = inc.listener.accept_all(inc.nprocs, deadline, on_hello, lambda: inc.status == "starting")
    inc.listener.close()  # nothing more may connect
    missing = sorted(_expected_ranks(inc) - arrived)
    with inc.lock:
        up = not missing and inc.life.move("idle", only_from=("starting",))
        if up:
            inc.ready_after = time.monotonic() - inc.started_at
            # Ranks nbdist started itself, on this machine, outlive a peer's death (an engine ends
            # them itself): from now on a death degrades the session instead of ending it.
            inc.rank_run.keep_survivors = engine is None and inc.options.nnodes == 1
            if inc.options.nnodes > 1:  # only now: the world formed, the store there is this world's
                inc.world = link_kernels(inc, inc.engine)
    if inc.status == "starting" and missing:
        _give_up_start(inc, missing)
        return False
    inc.ready.set()
    return up


def _give_up_start(inc, missing: list[int]) -> None:
    """The start deadline passed: say which ranks never connected and where they were, then stop."""
    from nbdist.run.stacks import dump_stacks

    pids = {r: p for r, p in inc.rank_run.local_pids().items() if r in missing}
    dumps = dump_stacks({r: (pid, rundir.log_path(inc.run_dir, r, "stderr")) for r, pid in pids.items()},
                        timeout=2.0)
    where: dict[str, list[int]] = {}
    for rank in missing:
        dump = dumps.get(rank)
        said = dump.where if dump else ("had not registered" if rank not in inc.rank_run.pids else
                                        "left no stack" if rank in pids else "runs on another machine")
        where.setdefault(said, []).append(rank)
    places = "; ".join(f"{format_rank_set(ranks)} {said}" for said, ranks in where.items())
    inc.lose(f"the session could not start within {inc.start_timeout:g} s: {format_rank_set(missing)} never connected "
             f"to the kernel ({places}; stacks in the rank logs under {inc.run_dir}); on a busy machine give "
             f"more time with start_timeout= (%dist_start --start-timeout)")
