"""``nbdist ps`` and ``nbdist kill [RUN_ID]``: find and end leftover ranks from a shell."""

from __future__ import annotations

import argparse
import sys

from .api import kill, ps
from .proctree import MarkedProcess

__all__ = ["main", "format_table"]


def format_table(procs: list[MarkedProcess]) -> str:
    """The same columns as ``%dist_ps``: run id, rank, pid, age, memory, command."""
    if not procs:
        return "no nbdist processes are running"
    rows = [("RUN ID", "RANK", "PID", "AGE", "MEMORY", "COMMAND")]
    for p in sorted(procs, key=lambda p: (p.run_id, p.rank if p.rank is not None else 1 << 30, p.pid)):
        rows.append((
            p.run_id,
            "-" if p.rank is None else str(p.rank),
            str(p.pid),
            f"{p.age:.0f}s",
            f"{p.rss / 2**20:.0f} MiB",
            p.cmdline[:60],
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="nbdist", description="Find and stop nbdist ranks left running.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_ps = sub.add_parser("ps", help="list live processes that carry a run's marker")
    p_ps.add_argument("run_id", nargs="?", default=None)
    p_kill = sub.add_parser("kill", help="stop the processes of one run, or of every run")
    p_kill.add_argument("run_id", nargs="?", default=None)
    args = parser.parse_args(argv)
    if args.command == "ps":
        print(format_table(ps(args.run_id)))
        return 0
    n = kill(args.run_id)
    print(f"stopped {n} process{'es' if n != 1 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
