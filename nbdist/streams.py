"""Per-rank output: follow the log files the ranks write, and assemble lines the way a terminal would.

Ranks write fd 1 and 2 straight into ``rank{R}.stdout``/``.stderr`` in the run dir, so every
byte is on disk before any view sees it (nothing is lost when a view truncates or the kernel
dies). The kernel follows those files, like torch elastic's log tailing, and turns the bytes
into lines: ``\\n`` ends a line, ``\\r`` rewinds it (a tqdm bar stays one line), ANSI colour
codes pass through untouched.
"""

from __future__ import annotations

import codecs
import collections
import os
import time
from dataclasses import dataclass, field

__all__ = ["LineAssembler", "LogFollower", "OutputChunk", "RankOutput"]


@dataclass
class OutputChunk:
    """New output of one rank's stream: finished lines, plus the line still being written."""

    rank: int
    stream: str  # "stdout" or "stderr"
    lines: list[str]
    pending: str  # the unfinished last line after \r handling ("" when none)
    time: float = field(default_factory=time.time)


class LineAssembler:
    """Turn a character stream into lines with terminal semantics for ``\\r``.

    ``"a\\rb\\n"`` is the line ``"b"``; ``"50%\\r100%\\n"`` is ``"100%"``; ``"x\\r\\n"`` keeps ``"x"``.
    """

    def __init__(self):
        self._line: list[str] = []
        self._rewind = False

    @property
    def pending(self) -> str:
        return "".join(self._line)

    def feed(self, text: str) -> list[str]:
        done = []
        start = 0
        n = len(text)
        while start < n:
            # Find the next control character; copy the plain run before it in one go.
            i = start
            while i < n and text[i] not in "\r\n":
                i += 1
            if i > start:
                if self._rewind:
                    self._line.clear()
                    self._rewind = False
                self._line.append(text[start:i])
            if i < n:
                if text[i] == "\n":
                    done.append("".join(self._line))
                    self._line.clear()
                    self._rewind = False
                else:
                    self._rewind = True
            start = i + 1
        return done

    def flush(self) -> list[str]:
        """End of stream: the unfinished line becomes a line."""
        rest = self.pending
        self._line.clear()
        self._rewind = False
        return [rest] if rest else []


class LogFollower:
    """Follow one growing log file from where it was last read, decoding UTF-8 incrementally."""

    def __init__(self, path: str, max_chunk: int = 1 << 20):
        self.path = path
        self.offset = 0
        self.fed = 0  # bytes that came through feed() rather than the file
        self.max_chunk = max_chunk
        self._fh = None
        self._closed = False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, offset: int, data: bytes) -> str:
        """Bytes of the same file that arrived another way (the output channel), at ``offset``.

        Only what lies beyond what was already read is taken, so each byte counts once. A piece
        beyond a gap is dropped: the file itself has those bytes and will be read.
        """
        if self._closed or offset > self.offset or offset + len(data) <= self.offset:
            return ""
        new = data[self.offset - offset:]
        self.offset += len(new)
        self.fed += len(new)
        return self._decoder.decode(new)

    def read_new(self) -> str:
        if self._closed:
            return ""
        if self._fh is None:
            try:
                self._fh = open(self.path, "rb")
            except FileNotFoundError:
                return ""
        self._fh.seek(self.offset)
        data = self._fh.read(self.max_chunk)
        self.offset += len(data)
        return self._decoder.decode(data)

    def close(self) -> str:
        self._closed = True
        rest = self._decoder.decode(b"", final=True)
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        return rest


class RankOutput:
    """One rank's two streams: followers on its log files, line assembly, and a bounded line buffer."""

    def __init__(self, run_dir: str, rank: int, max_lines: int = 5000):
        self.rank = rank
        self._followers = {
            s: LogFollower(os.path.join(run_dir, f"rank{rank}.{s}")) for s in ("stdout", "stderr")
        }
        self._assemblers = {s: LineAssembler() for s in ("stdout", "stderr")}
        self.lines: collections.deque[tuple[str, str]] = collections.deque(maxlen=max_lines)
        self.total_lines = 0

    @property
    def bytes_from_channel(self) -> int:
        return sum(f.fed for f in self._followers.values())

    def poll(self, final: bool = False, pieces=()) -> list[OutputChunk]:
        """New chunks; ``pieces`` are ``(stream, offset, bytes)`` from the output channel."""
        chunks = []
        for stream, follower in self._followers.items():
            text = "".join(follower.feed(off, data) for s, off, data in pieces if s == stream)
            text += follower.read_new()
            if final:
                text += follower.read_new() + follower.close()
            asm = self._assemblers[stream]
            before = asm.pending
            lines = asm.feed(text) if text else []
            if final:
                lines += asm.flush()
            if lines or asm.pending != before:
                self.lines.extend((stream, line) for line in lines)
                self.total_lines += len(lines)
                chunks.append(OutputChunk(self.rank, stream, lines, asm.pending))
        return chunks
