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
    """One line for a kernel's helper (a warm template, a store host): whose it is, its size, and whether
    it is a leftover."""
    whose = "this process's" if p.ppid == os.getpid() else f"kernel pid {p.owner.pid if p.owner else p.ppid}"
    what = "store host" if p.is_store_host else "warm template"
    text = f"{what} pid {p.pid} ({whose}, {p.rss / 2**20:.0f} MiB, up {p.age:.0f} s)"
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


_DESCRIPTION = """\
Find and stop nbdist processes left running: ranks of runs and sessions, and warm templates.

Every nbdist process carries its run's marker in its environment; these commands find processes by
that marker, never by name, and touch only your own."""

_PS_HELP = """\
List live nbdist processes of yours: one row per rank or child process, with its run id, rank, pid,
age, memory, whose it is (this process's, a live kernel's with its pid, or orphaned: its kernel is
gone) and its command line. Warm templates (the processes ranks are forked from) are listed after
the table. The last line says how many run dirs (logs) are kept and where."""

_KILL_HELP = """\
Stop nbdist processes: SIGTERM, then SIGKILL after a few seconds, to each rank's whole process
tree (DataLoader workers and other children included).

From a shell, a plain `nbdist kill` ends orphans only: processes whose kernel is gone. A live
kernel's runs and sessions are left alone. (In a notebook, `%dist_kill` ends that kernel's own
runs and the orphans.) Name a RUN_ID to end that one run, whoever's it is, or give --all."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nbdist", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{ps,kill}")
    p_ps = sub.add_parser("ps", help="list live nbdist processes of yours, each saying whose it is",
                          description=_PS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p_ps.add_argument("run_id", nargs="?", default=None, metavar="RUN_ID",
                      help="list only this run's processes (the ids `nbdist ps` shows)")
    p_kill = sub.add_parser("kill", help="stop orphans (whose kernel is gone), one run, or --all",
                            description=_KILL_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p_kill.add_argument("run_id", nargs="?", default=None, metavar="RUN_ID",
                        help="stop this run's processes, whoever's they are (a live kernel's too)")
    p_kill.add_argument("--all", action="store_true",
                        help="also stop the runs and sessions of live kernels: every nbdist rank of yours "
                             "(a live kernel's warm template stays; it is not a run)")
    return parser


def main(argv=None) -> int:
    """``nbdist ps [RUN_ID]`` and ``nbdist kill [--all] [RUN_ID]``; see ``nbdist --help``."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "ps":
            print(format_table(ps(args.run_id)))
            print(describe_retention(choose_runs_root()))
            return 0
        if args.run_id is not None and args.all:
            print("nbdist: error: give a RUN_ID or --all, not both", file=sys.stderr)
            return 2
        if args.run_id is not None and not ps(args.run_id):
            print(f"nbdist: no live process carries run id {args.run_id!r}; `nbdist ps` lists the runs",
                  file=sys.stderr)
            return 1
        n = kill(args.run_id, all=args.all)
    except (OSError, ValueError) as exc:  # the runs root refused (not private), /proc unreadable: one line
        print(f"nbdist: error: {exc}", file=sys.stderr)
        return 2
    print(f"stopped {n} process{'es' if n != 1 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
