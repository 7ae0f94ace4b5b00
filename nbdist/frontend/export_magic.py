"""``%dist_export``: the live session written as a job (:mod:`nbdist.session.job_export`), with the
notebook's own definitions (:mod:`nbdist.frontend.export_notebook`)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from IPython.core.error import UsageError

__all__ = ["export_session", "parse_cell_range"]


def parse_cell_range(text: str | None) -> tuple[int, int] | None:
    """``"3-12"`` -> ``(3, 12)``; ``"7"`` -> ``(7, 7)``; a bad range is a one-line UsageError."""
    if not text:
        return None
    first, sep, last = text.partition("-")
    try:
        span = (int(first), int(last) if sep else int(first))
    except ValueError:
        raise UsageError(f"--cells takes A-B (the cells In [A] to In [B]), got {text!r}") from None
    if span[0] > span[1]:
        raise UsageError(f"--cells {text}: the first cell comes after the last")
    return span


def export_session(shell, args) -> str:
    """Write the job; return the one line that says what went where."""
    from nbdist.frontend.export_notebook import add_notebook_definitions
    from nbdist.frontend.notebook_cells import notebook_cells, notebook_file_cells
    from nbdist.frontend.one_shot_cells import one_shot_history
    from nbdist.frontend.session_magics import live_session
    from nbdist.session.job_export import plan_job, plan_one_shot_job, write_job

    session = live_session()
    one_shot = one_shot_history().records() if session is None else []
    if session is None and not one_shot:
        raise UsageError("nothing to export: no session, and no %%distributed cell has run; run the cells "
                         "(in a session: %dist_start), then %dist_export job.py")
    if args.nprocs is not None and args.nprocs < 1 or args.nnodes < 1:
        raise UsageError("--nprocs and --nnodes take a positive number")
    path = os.path.abspath(os.path.expanduser(args.path))
    if not os.path.isdir(os.path.dirname(path)):
        raise UsageError(f"no folder {os.path.dirname(path)!r} to write {os.path.basename(path)} into")
    t0 = time.monotonic()
    # Values a cell got that were not kept go here first: the session's run dir, else a dir of the export's.
    folder = session.run_dir if session else tempfile.mkdtemp(prefix="nbdist-export-")
    try:
        cells = parse_cell_range(args.cells)
        # No session: the notebook's one-shot cells, each of which ran on ranks of its own.
        plan = (plan_job(session.incarnation, cells, as_ran=args.as_ran) if session
                else plan_one_shot_job(one_shot, args.nprocs, cells))
        plan.notebook, saved = notebook_file_cells(shell)
        add_notebook_definitions(plan, notebook_cells(shell), saved)
        for i, step in enumerate(plan.steps):
            if step.value_names and (step.values_from is None or not os.path.exists(step.values_from)):
                _take_values_now(shell, plan, step, os.path.join(folder, f"export-values-{i}.nbv"))
        written = write_job(plan, path, args.launcher, args.nprocs, args.nnodes)
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    finally:
        if session is None:  # what it held is copied beside the job
            shutil.rmtree(folder, ignore_errors=True)
    cells = sum(1 for s in plan.steps if not s.notebook)
    beside = ", ".join(os.path.basename(p) + ("/" if os.path.isdir(p) else "") for p in written[1:])
    left = f"; left out: {'; '.join(plan.left_out)}" if plan.left_out else ""
    left += f"; replayed to where they ended: {'; '.join(plan.replayed)}" if plan.replayed else ""
    kind = "session" if session else "%%distributed"
    return (f"nbdist: wrote {args.path} ({cells} {kind} cell{'s' if cells != 1 else ''}, "
            f"{len(plan.steps) - cells} notebook cell{'s' if len(plan.steps) - cells != 1 else ''}; "
            f"{beside} beside it) in {time.monotonic() - t0:.2f} s{left}; run it: python {args.path}")


def _take_values_now(shell, plan, step, path: str) -> None:
    """The values a cell got were not kept (too big, or pruned): the notebook's values now go instead,
    and the header says so."""
    from nbdist.protocol.shared_values import write_value_file

    now = {n: shell.user_ns[n] for n in step.value_names if n in shell.user_ns}
    label = step.label.split(" · ")[0]
    gone = sorted(set(step.value_names) - set(now))
    if gone:
        plan.left_out.append(f"{label}: the notebook no longer holds {', '.join(gone)}, which it read: the job lacks them")
    if now:
        plan.notes.append(f"{label}: the values it got of {', '.join(sorted(now))} were not kept (over 64 MB, or "
                          f"pruned): the notebook's values now go instead")
        write_value_file(path, now, "the notebook's values")
    step.values_from, step.value_names = (path if now else None), sorted(now)
