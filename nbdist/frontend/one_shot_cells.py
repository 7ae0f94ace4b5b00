"""The kernel's one-shot ``%%distributed`` cells, kept for ``%dist_export`` when no session runs.

A one-shot cell starts fresh ranks and ends them with its run: each is a world of its own, and
nothing of it outlives the run but its logs and what ``--pull`` brought back to the notebook. The
kernel keeps a :class:`~nbdist.session.cell_history.CellRecord` of each (its source, options, rank
count, the notebook values it read, kept beside its logs, and how it ended), so that a notebook of
one-shot cells, the quickstart's kind, exports as a job too: its cells run one after the other in
the job's one world (:func:`nbdist.session.job_export.plan_one_shot_job`).
"""

from __future__ import annotations

import itertools

from nbdist.session.cell_history import CellHistory, CellRecord

__all__ = ["record_one_shot", "one_shot_history"]

_HISTORY = CellHistory()  # this kernel's, for its life: one-shot cells belong to no session
_NUMBERS = itertools.count(1)


def record_one_shot(shell, job, run, line: str, cell: str, kept: str | None) -> CellRecord:
    """Keep the one-shot cell that ``run`` runs in the kernel's history, following its outcome
    (``kept``: the notebook values it was sent, kept past its end; see ``keep_notebook_values``)."""
    from nbdist.frontend.notebook_cells import current_cell_id

    text = cell if cell.endswith("\n") else cell + "\n"
    record = CellRecord(next(_NUMBERS), list(range(run.nprocs)), True, source=text, magic_line=line,
                        notebook_values=list(job.pushed), modules=dict(job.modules),
                        pushed_file=kept,
                        execution_count=getattr(shell, "execution_count", None), cell_id=current_cell_id(),
                        nprocs=run.nprocs)
    return _HISTORY.add(record.follow(run))


def one_shot_history() -> CellHistory:
    """The one-shot cells this kernel ran, in order."""
    return _HISTORY
