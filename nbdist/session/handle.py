"""Sessions: ranks that live across cells, keep their namespace and process group, take a cell in milliseconds.

:class:`Session` is the user's handle. The ranks themselves, and everything that acts on them,
are one :class:`~nbdist.session.incarnation.Incarnation`; :meth:`Session.restart` ends it and
makes a new one, so nothing of the old ranks (a late timer, a recovery step, a reply reader)
can ever act on the new ones. The cell-level calls (``run``, ``execute``, ``push``, ``pull``,
``interrupt``, ``stacks``) are :mod:`nbdist.session.cells`.

A world across nodes (torchrun --nnodes) has a session per kernel; the kernels stop, re-form and
go down together, agreeing through the world's store (:mod:`nbdist.session.peers`).

The channel that carries cells is code execution: ``multiprocessing.connection`` with a
per-incarnation key (a 0600 file in the 0700 run dir), listening on loopback unless the world
options ask for another address (:mod:`nbdist.run.rank_listener`).
"""

from __future__ import annotations

import contextlib
import numbers
import threading
import weakref

from nbdist.errors import LaunchConfigError
from nbdist.options import WorldOptions
from nbdist.protocol.session_channel import Autoreload
from nbdist.run.at_exit import close_at_exit
from nbdist.session.cells import CellLevel
from nbdist.session.incarnation import Incarnation

__all__ = ["Session"]

_LIVE: weakref.WeakSet = weakref.WeakSet()
API_RESTART_HINT = "restart() brings new ranks"


class Session(CellLevel):
    """Ranks that stay alive between cells, each with its namespace and its process group.

    Parameters are :func:`nbdist.launch`'s world options, plus ``start_timeout``: seconds the
    ranks may take to come up (default: 120, or 4 per rank beyond 30), after which the session
    says which ranks never connected and where they were; and ``check_collectives``: before each
    collective of every cell, the ranks compare what they call (op, group, sequence number, shapes,
    dtypes), so a mismatch is an error that names each rank's call instead of a hang
    (:mod:`nbdist.worker.flight_recorder`; it costs a store round trip per collective); and ``autoreload``:
    before each cell, every rank reloads the modules of the user's that changed on disk since it imported
    them, as IPython's ``%autoreload 2`` does (True; or a
    :class:`~nbdist.protocol.session_channel.Autoreload` for its other modes; the notebook's cells follow
    the kernel's ``%autoreload`` or ``%dist_autoreload`` instead). The ranks start in the background
    (forked from the warm template when it is ready); the constructor returns at once. ``heal="auto"``:
    a rank that dies is brought back from its peers at once (:meth:`heal`), and the cell that saw
    the death says so.

    Attributes
    ----------
    status : str
        "starting", "idle", "busy", "degraded" (a rank died; the survivors kept their state),
        "healing", "broken" or "closed".
    gone : dict
        rank -> how it died, for each rank of a degraded session.
    session_id, run_dir : str
        The marker of every process of the current ranks, and their record (logs, cells).
    restart_hint : str
        What a lost session's messages tell the user to do ("restart() brings new ranks"; the
        notebook's magics say "%dist_restart").

    Examples
    --------
    >>> s = nbdist.Session(nprocs=4)
    >>> s.execute("import torch, torch.distributed as dist\\nmodel = torch.nn.Linear(4, 1)")
    >>> s.run(lambda: dist.get_rank())
    {0: 0, 1: 1, 2: 2, 3: 3}
    >>> s.execute("model.weight.shape")     # the model is still there
    >>> s.close()
    """

    def __init__(self, nprocs=None, launcher="auto", backend="auto", env=None, run_dir=None, launcher_args=None,
                 nnodes=1, node_rank=0, master_addr=None, master_port=None, start_method=None, start_timeout=None,
                 check_collectives=False, autoreload=False, heal=None):
        self.options = WorldOptions.from_call(locals()).check()
        if launcher == "attach":
            raise LaunchConfigError("an attached kernel already is a persistent rank: run cells in it directly")
        if start_timeout is not None and (isinstance(start_timeout, bool) or not isinstance(start_timeout, numbers.Real)
                                          or start_timeout <= 0):
            raise LaunchConfigError(f"start_timeout must be a positive number of seconds, got {start_timeout!r}")
        self.start_timeout = start_timeout
        self.check_collectives = bool(check_collectives)
        self.autoreload = autoreload
        if heal not in (None, "off", "auto"):
            raise LaunchConfigError(f"heal must be 'auto' or None, got {heal!r}")
        self.heal_mode = "auto" if heal == "auto" else None
        self._hint = API_RESTART_HINT
        self._lock = threading.Lock()
        self._count = 0
        self._current = self._new_incarnation()
        _LIVE.add(self)

    def _new_incarnation(self) -> Incarnation:
        self._count += 1
        inc = Incarnation(self.options, self._count, self._hint, self.start_timeout)
        inc.heal_mode = self.heal_mode
        return inc

    @property
    def incarnation(self) -> Incarnation:
        """The current ranks and everything that acts on them."""
        return self._current

    @property
    def autoreload(self) -> Autoreload | None:
        """What the ranks reload before each of this handle's cells (None: nothing); set True, False
        or an :class:`~nbdist.protocol.session_channel.Autoreload`."""
        return self._autoreload

    @autoreload.setter
    def autoreload(self, value) -> None:
        if value is None or value is False:
            self._autoreload = None
        elif value is True:
            self._autoreload = Autoreload()
        elif isinstance(value, Autoreload) and value.mode in (0, 1, 2, 3):
            self._autoreload = value if value.mode else None
        else:
            raise LaunchConfigError(f"autoreload takes True, False or an nbdist Autoreload, got {value!r}")

    @property
    def restart_hint(self) -> str:
        return self._hint

    @restart_hint.setter
    def restart_hint(self, text: str) -> None:
        self._hint = self._current.restart_hint = text

    # ---- the current incarnation's state -------------------------------------------------------
    status = property(lambda self: self._current.status,
                      doc="starting, idle, busy, degraded, healing, broken or closed")
    lost_reason = property(lambda self: self._current.lost_reason, doc="why the ranks were lost, if they were")
    session_id = property(lambda self: self._current.session_id, doc="the marker of the current ranks")
    run_dir = property(lambda self: self._current.run_dir, doc="the current ranks' record: logs, cells")
    nprocs = property(lambda self: self._current.nprocs, doc="the number of ranks this kernel runs")
    address = property(lambda self: self._current.address, doc="where the ranks connected")
    ready_after = property(lambda self: self._current.ready_after, doc="seconds the ranks took to come up")
    last_reform = property(lambda self: self._current.last_reform, doc="each rank's timings of the last re-forming")
    defined_names = property(lambda self: self._current.defined_names, doc="names cells defined on the ranks")
    rank_run = property(lambda self: self._current.rank_run, doc="the ranks' run (nbdist.run.state.Run)")
    last_heal = property(lambda self: self._current.last_heal,
                         doc="the last heal's report (a HealReport), or the error that stopped it")

    @property
    def gone(self) -> dict[int, str]:
        """rank -> how it died, for the ranks a degraded session lacks until the heal."""
        return {r: g.how() for r, g in sorted(self._current.gone.items())}

    @property
    def pids(self) -> dict[int, int]:
        """rank -> pid of each rank that said hello (and lives)."""
        return dict(sorted(self._current.pids.items()))

    def local_pids(self, ranks) -> list[int]:
        """The pids of ``ranks`` that run on this machine: the ones a signal may reach."""
        return self._current.local_pids(ranks)

    def ranks_elsewhere(self) -> list[int]:
        """Ranks of the world that other kernels drive (a session across nodes, torchrun --nnodes)."""
        return self._current.ranks_elsewhere()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every rank is up (True; False on ``timeout``); raise SessionLostError if it can't serve."""
        return self._current.wait_ready(timeout)

    # ---- session level -------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """End the session: ranks leave their loop (atexit handlers run), then the tree is stopped."""
        with self._lock:
            current = self._current
        current.close(timeout)
        _LIVE.discard(self)

    def heal(self, donor: int | None = None):
        """Bring the ranks that died back from their peers: a degraded session becomes idle again.

        Each dead rank starts again (same rank number, device, environment and marker), joins
        every process group in place (the survivors' group objects, DDP models and their groups stay
        the same objects), and takes from ``donor`` (default: the lowest survivor) every name that
        all survivors hold alike. Rank-specific names, names only some survivors hold, and values
        that can't be pickled are listed, not copied. Raises RuntimeError, in one line, where it
        can't heal (ranks an engine started, a session lost or with no dead rank); a heal that fails
        stops the new ranks and leaves the session degraded as it was.

        Returns a :class:`~nbdist.session.healing.HealReport`; ``str()`` of it is the message.

        Examples
        --------
        >>> session.status
        'degraded'
        >>> print(session.heal())
        healed rank 2 from rank 0 in 3.1 s (start 1.2 s, re-form 0.9 s, copy 1.0 s): 9 names copied
        rank-specific, not copied (they differ between survivors): rank
        """
        return self._current.heal(donor)

    def export(self, path: str, cells: tuple[int, int] | None = None, launcher: str = "torchrun",
               nprocs: int | None = None, nnodes: int = 1, as_ran: bool = False) -> list[str]:
        """Write this session's cells as a job that runs the same under ``python``, torchrun, srun and mpirun.

        The script at ``path`` holds the cells that finished (``execute`` source, ``run`` calls
        pickled beside it), in the order they ran, each guarded by the ranks it ran on, after
        ``nbdist.join_job``; its header says how to run it, what the session ran on, and which cells
        are left out and why. ``<stem>.sbatch`` beside it runs it with srun. ``%dist_export`` does
        the same in a notebook, with the notebook's own definitions the cells read. ``cells``: the
        session's cell numbers to take (first, last); ``launcher``: the engine the header and the batch
        file lead with; ``nprocs``, ``nnodes``: the job's world (default: the session's ranks, one node);
        ``as_ran``: a cell that was stopped at a point every rank agreed on, or that failed, goes in
        too, replayed to where it ended (each rank stops before the collective it stopped before).

        Returns the paths written; raises ValueError when no cell can be exported, and
        FileNotFoundError for a folder that doesn't exist.

        Examples
        --------
        >>> session.export("job.py")
        ['/home/me/job.py', '/home/me/job.sbatch']
        >>> # then, in a shell: python job.py   or   torchrun --nproc-per-node 4 job.py
        """
        from nbdist.session.job_export import plan_job, write_job

        return write_job(plan_job(self._current, cells, as_ran), path, launcher, nprocs, nnodes)

    def restart(self) -> None:
        """End the current ranks (or what is left of them) and start new ones with the same options.

        The new ranks are a new incarnation: nothing of the old ones can act on them.
        """
        with self._lock:
            self._current.close()
            self._current = self._new_incarnation()
        _LIVE.add(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self) -> str:
        gone = "".join(f"; rank {r} {how}" for r, how in self.gone.items())
        return f"<nbdist.Session {self.session_id} {self.status} nprocs={self.nprocs}{gone}>"


def _close_live_sessions() -> None:
    for session in list(_LIVE):
        with contextlib.suppress(Exception):
            session.close(timeout=2.0)


close_at_exit("sessions", _close_live_sessions)
