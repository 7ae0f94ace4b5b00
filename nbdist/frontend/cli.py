"""``nbdist ps`` and ``nbdist kill [--all] [RUN_ID]``: find and end leftover ranks from a shell.

From a shell there is no kernel of one's own: ``nbdist kill`` ends orphans (processes whose
kernel is gone), a run by its id, or everything with ``--all``; a live kernel's runs stay.
"""

from __future__ import annotations

import argparse
import os
import sys

from nbdist.api import kill, ps
from nbdist.protocol.rundir import choose_runs_root
from nbdist.run.processes import MarkedProcess
from nbdist.run.retention import describe_retention

__all__ = ["main", "format_table", "sort_procs", "describe_template"]


def sort_procs(procs: list[MarkedProcess]) -> list[MarkedProcess]:
    """By run, then rank (ranks before their children), then pid: the order of both views."""
    return sorted(procs, key=lambda p: (p.run_id, p.rank if p.rank is not None else 1 << 30, p.pid))


def describe_template(p: MarkedProcess) -> str:
    """One line for a warm template: whose it is, its size, and whether it is a leftover."""
    whose = "this process's" if p.ppid == os.getpid() else f"kernel pid {p.owner.pid if p.owner else p.ppid}"
    text = f"warm template pid {p.pid} ({whose}, {p.rss / 2**20:.0f} MiB, up {p.age:.0f} s)"
    if p.orphaned:
        text += f": orphaned, its kernel is gone; `nbdist kill {p.run_id}` ends it"
    return text


def format_table(procs: list[MarkedProcess]) -> str:
    """The same columns as ``%dist_ps``: run id, rank, pid, age, memory, whose, command.

    Warm templates are not ranks: they are listed after the table, one line each, so "is
    anything of mine still running?" reads from the first line.
    """
    ranks = [p for p in procs if not p.is_template]
    lines = ["no nbdist ranks are running"] if not ranks else []
    if ranks:
        rows = [("RUN ID", "RANK", "PID", "AGE", "MEMORY", "WHOSE", "COMMAND")]
        for p in sort_procs(ranks):
            rows.append((p.run_id, "-" if p.rank is None else str(p.rank), str(p.pid), f"{p.age:.0f}s",
                         f"{p.rss / 2**20:.0f} MiB", p.whose(), p.cmdline[:60]))
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r[:6], widths)) + "  " + r[6] for r in rows]
    lines += [describe_template(p) for p in sort_procs([p for p in procs if p.is_template])]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="nbdist", description="Find and stop nbdist ranks left running.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_ps = sub.add_parser("ps", help="list live processes that carry a run's marker")
    p_ps.add_argument("run_id", nargs="?", default=None)
    p_kill = sub.add_parser("kill", help="stop orphans (whose kernel is gone), one run, or --all")
    p_kill.add_argument("run_id", nargs="?", default=None)
    p_kill.add_argument("--all", action="store_true", help="every nbdist process of yours, live kernels' too")
    args = parser.parse_args(argv)
    if args.command == "ps":
        print(format_table(ps(args.run_id)))
        print(describe_retention(choose_runs_root()))
        return 0
    n = kill(args.run_id, all=args.all)
    print(f"stopped {n} process{'es' if n != 1 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
