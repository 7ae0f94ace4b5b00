"""What users do with a :class:`nbdist.Session`'s cells: run a function or source text on its ranks,
push and pull names, press stop, see the stacks.

Each call acts on the session's current incarnation (:mod:`nbdist.session.incarnation`), taken
once at the start of the call; stopping a cell and bringing the ranks back in step afterwards is
:mod:`nbdist.session.recovery`.
"""

from __future__ import annotations

import os

from nbdist.protocol import rundir
from nbdist.protocol.shared_values import dump_shared
from nbdist.session.cell_handle import CellHandle
from nbdist.session.cell_history import CellRecord
from nbdist.session.pieces import join_pieces, split_in_pieces
from nbdist.worker.session_loop import get_name, set_shared_names, set_shared_piece, sync_replicas

__all__ = ["CellLevel"]


class CellLevel:
    """What a :class:`nbdist.Session` does with cells (a mixin over its ``incarnation``)."""

    def run(self, fn, *args, ranks=None, timeout=None, join=True, **kwargs):
        """Run ``fn(*args, **kwargs)`` on the session's ranks (or ``ranks``); return ``{rank: value}``.

        Raises WorkerFailedError (the rank that raised first, with its traceback) when a rank
        raised; the ranks are then idle again with their state kept. ``join=False`` returns the
        :class:`~nbdist.session.cell_handle.CellHandle`. ``timeout`` interrupts the cell when it expires.
        """
        cell = self._submit(lambda cell_dir, held: rundir.pack_payload(fn, args, kwargs, sources_held=held),
                            ranks, timeout)
        if not getattr(fn, "__module__", "").startswith("nbdist."):  # nbdist's own reads change nothing
            self._record(cell, ranks, what="function", call=(fn, args, kwargs))
        return cell if not join else cell.wait()

    def execute(self, code: str, ranks=None, timeout=None, join=True, check_collectives=None):
        """Run source text on the ranks, in their ``__main__``: its last expression is each rank's value.

        ``check_collectives`` (default: the session's setting) makes the ranks compare each
        collective before they issue it (see :class:`nbdist.Session`)."""
        import ast

        from nbdist.worker.cell import run_cell

        def pack(cell_dir, held):
            cell_file = os.path.join(cell_dir, "cell.py")
            text = code if code.endswith("\n") else code + "\n"
            ast.parse(text, filename=cell_file)  # a SyntaxError names the line before anything runs
            rundir.write_private(cell_file, text.encode("utf-8"))  # the record: the ranks get the text with the cell
            return rundir.pack_payload(run_cell, (cell_file, False, {}, [], text), {}, sources_held=held)

        cell = self._submit(pack, ranks, timeout, check_collectives)
        self._record(cell, ranks, source=code if code.endswith("\n") else code + "\n")
        return cell if not join else cell.wait()

    def push(self, ranks=None, **values) -> None:
        """Set ``values`` as names in each rank's namespace.

        Tensors and arrays go through shared memory: written once, mapped copy-on-write by each
        rank on this machine (each rank's value is its own); see :mod:`nbdist.protocol.shared_values`.

        Examples
        --------
        >>> session.push(weights=torch.randn(4096, 4096), lr=0.1)
        """
        self._share(set_shared_names, values, ranks)

    def pull(self, name: str, ranks=None) -> dict:
        """``{rank: value}`` of ``name`` in each rank's namespace (big values through shared memory).

        Examples
        --------
        >>> session.pull("loss")
        {0: 0.12, 1: 0.11}
        """
        return self.run(get_name, name, ranks=ranks)

    def scatter(self, name: str, seq, dim: int = 0, ranks=None) -> None:
        """Split ``seq`` (a tensor, an array, a list) in as many pieces as ranks, along ``dim``, and set
        rank r's piece as ``name`` on it (ranks in order; the first pieces one longer when it doesn't divide).

        Examples
        --------
        >>> session.scatter("shard", torch.arange(10))      # rank 0: tensor([0, 1, 2, 3, 4]) of 2 ranks
        """
        targets = sorted(self.incarnation.conns) if ranks is None else sorted(set(ranks))
        pieces = dict(zip(targets, split_in_pieces(seq, len(targets), dim)))
        self._share(set_shared_piece, pieces, targets, name)

    def gather(self, name: str, dim: int = 0, ranks=None):
        """``name`` from each rank, joined in rank order along ``dim`` (tensors, arrays, lists): the
        inverse of :meth:`scatter`.

        Examples
        --------
        >>> session.gather("shard")
        tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
        """
        return join_pieces([value for _, value in sorted(self.pull(name, ranks=ranks).items())], dim)

    def _share(self, fn, values, ranks, *first):
        """Run ``fn(*first, shared)`` on ``ranks``, ``values`` shared for the cell's length."""
        inc = self.incarnation
        targets = sorted(inc.conns) if ranks is None else ranks
        local = not any(r in inc.remote for r in targets)  # another machine's ranks can't map our memory
        shared = dump_shared(values, "a pushed value", local=local)
        try:
            cell = self.run(fn, *first, shared, ranks=ranks, join=False)
            self._record(cell, ranks, what="values", value_names=list(first) or sorted(values))
            cell.wait()
        finally:
            shared.close()  # every rank mapped it (or the cell ended without it)

    def _submit(self, pack, ranks, timeout, check_collectives=None, stdin: bool = False) -> CellHandle:
        """Start a cell whose payload ``pack(cell_dir, sources_held)`` makes (``(bytes, sources sent)``)."""
        inc = self.incarnation  # one incarnation for the whole call, even if another thread restarts
        targets = inc.prepare(ranks)
        cell_dir = inc.new_cell_dir()
        try:
            payload, sent = pack(cell_dir, inc.sources_held)  # the notebook sources the ranks lack
        except BaseException:
            rundir.discard_run_dir(cell_dir)
            raise
        check = self.check_collectives if check_collectives is None else check_collectives
        cell = inc.start_cell(cell_dir, targets, payload, timeout, check_collectives=check, stdin=stdin,
                              autoreload=self.autoreload)
        inc.note_sources_sent(targets, sent)
        return cell

    def _record(self, cell: CellHandle, ranks, **what) -> None:
        """Keep the user's cell in its incarnation's history (what an export reads)."""
        inc = cell.incarnation
        inc.history.add(CellRecord(cell.cell_id, list(cell.targets), ranks is None, **what).follow(cell))

    def sync(self, src: int = 0, timeout: float | None = 120) -> str:
        """Re-sync every DDP model's replicas, and their optimizers' state, from rank ``src``.

        For replicas that a stop or a ``--ranks`` cell left apart (the cell's message says so). The
        ranks compare the models' and optimizers' structure first, and change nothing if they
        differ; a rank whose optimizer has no state yet gets ``src``'s. Parameters and buffers,
        every optimizer state tensor (Adam's moments and step), and the param groups' settings
        (``lr``, ...) come from ``src``, through the session's process group. FSDP2 shards differ by
        design and are left alone. Returns what was done, in one line.

        Examples
        --------
        >>> session.sync()            # %dist_sync
        're-synced 1 DDP model (4 tensors, 1.2 kB) and 1 optimizer (12 state tensors) from rank 0 in 31 ms'
        >>> session.sync(src=2)       # %dist_sync --from 2
        """
        from nbdist.session.replica_check import describe_sync

        inc = self.incarnation
        if src not in inc.pids:
            raise ValueError(f"rank {src} is not one of the session's ranks ({sorted(inc.pids)})")
        cell = self.run(sync_replicas, src, timeout=timeout, join=False)
        # In the history: it changed the replicas, and an export must change them at the same point.
        self._record(cell, None, what="sync", source=str(src))
        return describe_sync(cell.wait()[src])

    def interrupt(self) -> None:
        """The stop button: interrupt the running cell, if any; the ranks keep their state."""
        cell = self.incarnation.active
        if cell is not None and not cell.done:
            cell.incarnation.interrupt_cell(cell)

    def collectives(self, ranks=None, timeout: float = 1.0) -> dict:
        """What each rank of the running cell waits in, from its flight recorder: ``{rank: report}``,
        ``report["open"]`` the open collectives (oldest first), ``report["last"]`` its last ones.
        Empty while no cell runs.

        Examples
        --------
        >>> session.collectives()[1]["open"]
        ['broadcast #12 float32[3] from rank 1 on the default group, waiting 4.2 s']
        """
        from nbdist.session.collectives import ask_open_collectives

        inc = self.incarnation
        cell = inc.active
        if cell is None or cell.done:
            return {}
        return ask_open_collectives(inc, cell, ranks, timeout)

    def stacks(self, ranks=None, timeout: float = 2.0) -> dict:
        """Every rank's Python stack, now, without stopping anything: ``{rank: StackDump}``.

        The answer to "is it hung, and where?". Each dump also goes into the rank's log.
        """
        return self.incarnation.stacks(ranks, timeout)
