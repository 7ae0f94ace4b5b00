"""Stack dumps: what a rank's faulthandler wrote into its log when the kernel asked, read back.

On a timeout the kernel sends each rank the stack-dump signal (:mod:`nbdist.worker.bootstrap` installs the
handler before anything slow, so a rank still importing torch answers too). faulthandler writes
every thread's stack into the rank's stderr log, most recent call first. This module finds that
dump after a known offset, picks the rank's own thread (not nbdist's parent watch), and says where
it stood in one phrase (``torch/__init__.py:290 in <module>``) for the error's first line.
Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass

__all__ = ["StackDump", "parse_dump", "read_dump", "dump_stacks"]

_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):\s*$")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
# Threads of nbdist's own that are never where a rank "is".
_HELPERS = ("_watch_parent", "nbdist/worker/output_mirror.py")
_SHOWN_FRAMES = 12


@dataclass
class StackDump:
    """One rank's dump: all of it as written, its own thread, and where that thread stood."""

    text: str
    main: str
    where: str | None


def _short(path: str) -> str:
    """``.../site-packages/torch/__init__.py`` -> ``torch/__init__.py``; else the path as it is."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _is_plumbing(path: str) -> bool:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # all of nbdist/
    return (path.startswith(here) or path.startswith("<frozen ") or path == "<string>"
            or (os.sep + "multiprocessing" + os.sep) in path)


def parse_dump(text: str) -> StackDump | None:
    """The dump in ``text`` (faulthandler's format), or None when there is none (yet)."""
    blocks: list[tuple[bool, list[str]]] = []
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            blocks.append((header.group(1) == "Current thread", []))
        elif blocks and _FRAME.match(line):
            blocks[-1][1].append(line.rstrip())
    mine = [(current, frames) for current, frames in blocks
            if frames and not any(helper in f for helper in _HELPERS for f in frames)]
    if not mine:
        return None
    # The thread that took the signal is the rank's main thread (the watch thread holds it back);
    # failing that, the deepest stack, which is where a program's own work is.
    current, frames = next((b for b in mine if b[0]), max(mine, key=lambda b: len(b[1])))
    # The plumbing under every rank (multiprocessing's bootstrap, nbdist's worker, importlib's
    # frozen frames) says nothing; the log and ``text`` keep it.
    shown = [f for f in frames if not _is_plumbing(_FRAME.match(f)["file"])] or frames
    first = _FRAME.match(shown[0])
    where = f"at {_short(first['file'])}:{first['line']} in {first['func']}"
    outer = _FRAME.match(shown[-1])
    if outer["func"] == "<module>" and _short(outer["file"]) != outer["file"]:  # an import, the usual startup cost
        where = f"importing {_short(outer['file']).split(os.sep)[0].removesuffix('.py')}, {where}"
    more = len(shown) - _SHOWN_FRAMES
    main = "Stack (most recent call first):\n" + "\n".join(shown[:_SHOWN_FRAMES])
    if more > 0:
        main += f"\n  ... {more} more frames (the whole dump is in the rank's log)"
    return StackDump(text=text.strip(), main=main, where=where)


def read_dump(path: str, offset: int) -> StackDump | None:
    """The dump written to the log at ``path`` after byte ``offset``, or None."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            text = fh.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return None
    return parse_dump(text)


def dump_stacks(targets: dict, timeout: float) -> dict:
    """Ask each rank for its stack and read it back: ``{rank: StackDump}`` for those that answered.

    ``targets`` maps a rank to ``(pid, its stderr log)``; a pid of None (not started yet) is not
    signalled. A rank that holds the signal (still starting) answers once its handler is in.
    """
    from nbdist.protocol.signals import STACK_DUMP_SIGNAL

    sizes = {r: os.path.getsize(path) if os.path.exists(path) else 0 for r, (_, path) in targets.items()}
    asked = {r for r, (pid, _) in targets.items() if pid}
    for rank in asked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(targets[rank][0], STACK_DUMP_SIGNAL)
    dumps: dict = {}
    deadline = time.monotonic() + timeout
    while len(dumps) < len(asked) and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank in asked - set(dumps):
            dump = read_dump(targets[rank][1], sizes[rank])
            if dump is not None:
                dumps[rank] = dump
    return dumps
