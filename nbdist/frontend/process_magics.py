"""IPython front end for the processes themselves: ``%dist_ps``, ``%dist_kill``, ``%dist_logs`` and
``%dist_warm``, over :mod:`nbdist.api` and the warm template's handle.

They find a run's processes by its marker (never by name), and act on this kernel's runs and the
orphans of dead kernels; another live notebook's session is listed and left alone unless named.
"""

from __future__ import annotations

import html
import os

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from nbdist.api import kill, ps
from nbdist.frontend.cli import describe_template, format_table, sort_procs
from nbdist.protocol import registration, rundir
from nbdist.run.retention import describe_retention

__all__ = ["ProcessMagics"]


@magics_class
class ProcessMagics(Magics):
    """``%dist_ps``, ``%dist_warm``, ``%dist_kill`` and ``%dist_logs``, registered by ``%load_ext nbdist``."""

    @line_magic
    def dist_ps(self, line):
        """Show nbdist processes of any run (this kernel's, another's, a dead kernel's), each saying whose,
        with a button that stops this kernel's runs and the orphans (as ``%dist_kill``)."""
        from nbdist.frontend.session_magics import describe_dead_ranks

        procs = ps(line.strip() or None)
        dead = describe_dead_ranks()  # no process to list: the session's dead ranks are said below it
        if getattr(self.shell, "kernel", None) is None:
            print(format_table(procs) + dead)
            return None
        import ipywidgets as w

        table = w.HTML(_procs_html(procs))
        # What %dist_kill ends: this kernel's runs and orphans (another live kernel's are listed, not
        # killed), or the one run named.
        run_id = line.strip() or None
        targets = procs if run_id else [p for p in procs if (p.mine and not p.is_template) or p.orphaned]
        button = w.Button(description="Kill this run" if run_id else "Kill mine and orphans", icon="stop",
                          button_style="danger", disabled=not targets, layout=w.Layout(width="190px"),
                          tooltip="Stop this kernel's runs and sessions, and processes whose kernel is gone")
        status = w.HTML()

        def on_click(_):
            button.disabled = True
            n = kill(line.strip() or None)
            status.value = f"<span style='font-size:12px'>stopped {n} process{'es' if n != 1 else ''}</span>"
            table.value = _procs_html(ps(line.strip() or None))

        button.on_click(on_click)
        from IPython.display import display

        display(w.VBox([table, w.HBox([button, status])]))
        print(format_table(procs) + dead)
        return None

    @line_magic
    def dist_warm(self, line):
        """``%dist_warm [--refresh] [MODULE ...]``: start or refresh the warm template, preloading MODULEs.

        Ranks forked from it start in milliseconds. ``%dist_warm --off`` ends it (launches spawn).
        """
        from nbdist.warmstart import handle as warm

        words = line.split()
        if "--off" in words:
            retired = warm.retire_templates()
            tail = (f"; the template (pid {retired.pid}) exits once the ranks it forked have ended (live sessions "
                    f"and runs keep theirs)") if retired is not None else ""
            print(f"nbdist: warm start is off for this kernel until %dist_warm{tail}")
            return None
        modules = [w for w in words if not w.startswith("-")]
        bad = [m for m in modules if not all(part.isidentifier() for part in m.split("."))]
        if bad:
            raise UsageError(f"%dist_warm takes module names, got {', '.join(map(repr, bad))}")
        template = warm.warm(preload=modules, refresh="--refresh" in words, wait=True)
        took = f" in {template.ready_after:.1f} s" if template.ready_after else ""
        failed = template.info.get("failed") or []
        print(f"nbdist: {template.describe()}{took}; preload: {', '.join(template.preload) or '(torch only)'}")
        for line_ in failed:
            print(f"nbdist: preload failed: {line_}")
        return None

    @line_magic
    def dist_kill(self, line):
        """``%dist_kill [--all] [RUN_ID]``: stop this kernel's runs and orphans, one run, or everything.

        Another live notebook's session is left alone unless named by its run id or ``--all``.
        """
        words = line.split()
        every = "--all" in words
        named = [w for w in words if w != "--all"]
        if len(named) > 1 or any(w.startswith("-") for w in named):
            raise UsageError("%dist_kill takes [--all] [RUN_ID]")
        n = kill(named[0] if named else None, all=every)
        print(f"stopped {n} process{'es' if n != 1 else ''}")

    @line_magic
    def dist_logs(self, line):
        """``%dist_logs [RUN_ID] [RANK]``: print the logs of the last run (or of RUN_ID)."""
        parts = line.split()
        run = self.shell.user_ns.get("_dist")
        if parts and not parts[0].isdigit():
            run_dir = os.path.join(rundir.choose_runs_root(), parts.pop(0))
        elif run is not None:
            run_dir = run.log_dir  # a session cell's logs are its session's
        else:
            raise UsageError("no run yet: give a RUN_ID (see %dist_ps)")
        if not os.path.isdir(run_dir):
            raise UsageError(f"no run dir at {run_dir}")
        ranks = sorted(registration.read_rank_pids(run_dir)) or [0]
        if parts:
            ranks = [int(parts[0])]
        for rank in ranks:
            for stream in ("stdout", "stderr"):
                path = rundir.log_path(run_dir, rank, stream)
                if os.path.exists(path) and os.path.getsize(path):
                    with open(path, encoding="utf-8", errors="replace") as fh:
                        print(f"===== rank {rank} {stream} ({path})\n{fh.read()}", end="")
        print(f"nbdist: {describe_retention(os.path.dirname(run_dir))}")


def _procs_html(procs) -> str:
    ranks = [p for p in procs if not p.is_template]
    notes = "".join(f"<div style='font-size:12px;color:#666'>{html.escape(describe_template(p))}</div>"
                    for p in sort_procs([p for p in procs if p.is_template]))
    if not ranks:
        return f"<span style='font-size:12px'>no nbdist ranks are running</span>{notes}"
    head = "".join(f"<th style='text-align:left;padding:2px 10px'>{h}</th>"
                   for h in ("run id", "rank", "pid", "age", "memory", "whose", "command"))
    rows = []
    for p in sort_procs(ranks):
        cells = (p.run_id, "-" if p.rank is None else p.rank, p.pid, f"{p.age:.0f} s",
                 f"{p.rss / 2**20:.0f} MiB", p.whose(), p.cmdline[:70])
        rows.append("<tr>" + "".join(f"<td style='padding:2px 10px'><code>{html.escape(str(c))}</code></td>"
                                     for c in cells) + "</tr>")
    return f"<table style='font-size:12px'><tr>{head}</tr>{''.join(rows)}</table>{notes}"
