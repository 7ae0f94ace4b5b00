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

from nbdist.run.events import OutputChunk

__all__ = ["LineAssembler", "LogFollower", "RankOutput", "skip_note"]


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
    """Follow one growing log file from where it was last read, decoding UTF-8 incrementally.

    A rank can write faster than the kernel reads. When the unread part grows past ``skip_over``
    bytes, the follower jumps to the last ``keep_tail`` bytes (at a line start) and counts what it
    jumped over (:meth:`take_skipped`): the view shows the end of the output, which is the part
    people need (the final loss, the traceback), the kernel's memory stays bounded, and the log
    file keeps every byte.
    """

    def __init__(self, path: str, max_chunk: int = 1 << 20, skip_over: int = 8 << 20, keep_tail: int = 256 << 10):
        self.path = path
        self.offset = 0
        self.fed = 0  # bytes that came through feed() rather than the file
        self.max_chunk = max_chunk
        self.skip_over = skip_over
        self.keep_tail = keep_tail
        self._unreported: tuple[int, int] | None = None  # (lines, bytes) jumped over since take_skipped()
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
        size = os.fstat(self._fh.fileno()).st_size
        if size - self.offset > self.skip_over:
            self._skip_to_tail(size)
        self._fh.seek(self.offset)
        data = self._fh.read(self.max_chunk)
        self.offset += len(data)
        return self._decoder.decode(data)

    def read_to_end(self) -> str:
        """Everything left (after a jump to the tail if that is too much): the end of a run."""
        parts = []
        while True:
            text = self.read_new()
            if not text and (self._fh is None or self.offset >= os.fstat(self._fh.fileno()).st_size):
                return "".join(parts)
            parts.append(text)

    def _skip_to_tail(self, size: int) -> None:
        target = size - self.keep_tail
        lines = 0
        self._fh.seek(self.offset)
        while self._fh.tell() < target:  # count what is skipped, a block at a time (bounded memory)
            block = self._fh.read(min(1 << 20, target - self._fh.tell()))
            if not block:
                break
            lines += block.count(b"\n")
        rest = self._fh.readline()  # start the tail at a line start
        lines += rest.endswith(b"\n")
        new_offset = target + len(rest)
        skipped = new_offset - self.offset
        self.offset = new_offset
        self._decoder.reset()  # a character cut in two by the jump is not decoded across it
        old = self._unreported or (0, 0)
        self._unreported = (old[0] + lines, old[1] + skipped)

    def take_skipped(self) -> tuple[int, int] | None:
        """``(lines, bytes)`` jumped over since the last call, or None."""
        out, self._unreported = self._unreported, None
        return out

    def close(self) -> str:
        self._closed = True
        rest = self._decoder.decode(b"", final=True)
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        return rest


def skip_note(skipped: tuple[int, int], path: str) -> str:
    """The line a view shows where output was skipped, and where the whole of it is."""
    lines, nbytes = skipped
    return (f"[nbdist: {lines:,} lines ({nbytes / 2**20:.1f} MiB) skipped here, the rank wrote faster than "
            f"the kernel reads; every line is in {path}]")


class RankOutput:
    """One rank's two streams: followers on its log files, line assembly, and a bounded line buffer."""

    def __init__(self, run_dir: str, rank: int, max_lines: int = 5000):
        self.rank = rank
        self.followers = {
            s: LogFollower(os.path.join(run_dir, f"rank{rank}.{s}")) for s in ("stdout", "stderr")
        }
        self._assemblers = {s: LineAssembler() for s in ("stdout", "stderr")}
        self.lines: collections.deque[tuple[str, str]] = collections.deque(maxlen=max_lines)
        self.total_lines = 0

    def has_read_to(self, sizes) -> bool:
        """Whether both streams were read up to ``sizes`` ``(stdout, stderr)`` bytes of their logs."""
        return all(self.followers[s].offset >= n for s, n in zip(("stdout", "stderr"), sizes))

    def poll(self, final: bool = False, pieces=()) -> list[OutputChunk]:
        """New chunks; ``pieces`` are ``(stream, offset, bytes)`` from the output channel."""
        chunks = []
        for stream, follower in self.followers.items():
            text = "".join(follower.feed(off, data) for s, off, data in pieces if s == stream)
            text += follower.read_to_end() + follower.close() if final else follower.read_new()
            asm = self._assemblers[stream]
            before = asm.pending
            lines = []
            skipped = follower.take_skipped()
            if skipped:  # the jump comes before the new text: end the line that was being written first
                lines += asm.flush() + [skip_note(skipped, follower.path)]
            lines += asm.feed(text) if text else []
            if final:
                lines += asm.flush()
            if lines or asm.pending != before:
                self.lines.extend((stream, line) for line in lines)
                self.total_lines += len(lines)
                chunks.append(OutputChunk(self.rank, stream, lines, asm.pending))
        return chunks
