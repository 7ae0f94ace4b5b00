"""The default view in a notebook: it costs what the cell needs.

A cell that ends quickly (within :data:`GROW_AFTER_S`) with a few lines shows them as a plain cell
would: stream output, identical lines from several ranks folded into one (``[0-3] saved``), each
line prefixed by the ranks that printed it, no widget at all. A cell that runs longer, prints more,
or whose other ranks show rich output grows into the live tabbed view (:class:`.widget.WidgetView`),
which replays what came before, so nothing shown is lost. Its display carries a text/plain and an
HTML summary of how the cell ended and each rank's last lines, which frontends that don't render
widgets show (VS Code after reopening a notebook, GitHub, nbviewer, nbconvert).
"""

from __future__ import annotations

import html
import os
import time

from nbdist.errors import format_rank_set
from nbdist.frontend.views.buffer import FELL_BEHIND, BufferedView, format_report_line
from nbdist.frontend.views.cell_output import show_in_cell

__all__ = ["GrowingView", "fold_lines", "summarize", "grow_after_s", "GROW_AFTER_S", "QUICK_LINES"]

GROW_AFTER_S = 0.5  # a cell still running after this becomes the live view (NBDIST_GROW_AFTER_S)
QUICK_LINES = 20  # more folded lines than this, and it does too
SUMMARY_LINES = 5  # per rank, in the summary a grown view leaves for frontends without widgets


def grow_after_s() -> float:
    """How long a cell runs before it grows: ``NBDIST_GROW_AFTER_S`` (read at each cell, so ``%env``
    in the notebook sets it), else :data:`GROW_AFTER_S`. A kernel on a loaded or remote machine may
    want plain output for longer cells."""
    try:
        return max(0.0, float(os.environ.get("NBDIST_GROW_AFTER_S", GROW_AFTER_S)))
    except ValueError:
        return GROW_AFTER_S


def fold_lines(lines_by_rank: dict) -> list[tuple[str, str]]:
    """``[(stream, "[0-3] text")]``: the i-th line of each rank's stream, identical ones said once for all.

    Stream by stream (stdout's lines, then stderr's): a rank's two streams reach the kernel through
    two log files, so how one rank's stdout and stderr lines interleave says nothing; folding them
    together would split "[0-2] warned" by the timing of the reads.
    """
    streams = list(dict.fromkeys(stream for lines in lines_by_rank.values() for stream, _ in lines))
    out = []
    for stream in streams:
        texts = {r: [line for s, line in lines if s == stream] for r, lines in lines_by_rank.items()}
        ranks = sorted(r for r, lines in texts.items() if lines)
        for i in range(max((len(texts[r]) for r in ranks), default=0)):
            groups: dict[str, list[int]] = {}
            for r in ranks:
                if i < len(texts[r]):
                    groups.setdefault(texts[r][i], []).append(r)
            for line, who in groups.items():
                out.append((stream, f"[{format_rank_set(who).split(' ', 1)[1]}] {line}"))
    return out


def summarize(run, lines_by_rank: dict) -> tuple[str, str]:
    """``(text/plain, text/html)``: how the run or cell ended, and each rank's last ``(stream, line)``s."""
    head = f"nbdist {run.label} · {run.nprocs} ranks · {format_report_line(run)}"
    last = {r: list(lines)[-SUMMARY_LINES:] for r, lines in lines_by_rank.items()}
    folded = [line for _, line in fold_lines(last)]
    text = "\n".join([head, *folded, f"logs: {run.log_dir}"])
    rows = "".join(f"<div>{html.escape(line)}</div>" for line in folded)
    markup = (f"<div style='font-size:12px'><b>{html.escape(head)}</b><pre style='margin:2px 0'>{rows}</pre>"
              f"<span style='color:#5f6368'>logs: <code>{html.escape(run.log_dir)}</code></span></div>")
    return text, markup


class GrowingView(BufferedView):
    """Plain output for a quick cell; the live tabbed view for the others (see the module docstring)."""

    def __init__(self, run):
        super().__init__(run)
        self.grown = None  # the WidgetView, once the cell grew into it
        self._handle = None  # its display, updated with the summary at the end
        self._held: dict[int, list[tuple[str, str]]] = {}
        self._started = time.monotonic()
        self._grow_after = grow_after_s()
        run.subscribe(self.on_event)

    def on_event(self, event) -> None:
        if self.grown is None:  # once grown, the live view has its own subscription
            super().on_event(event)

    def flush(self, final: bool = False) -> None:
        if self.grown is not None:
            self.grown.flush(final)
            if final:
                self._leave_summary()
            return
        lines, _pending, _ = self.take()
        for rank, new in lines.items():
            self._held.setdefault(rank, []).extend(new)
        first = min(self.run.global_rank(r) for r in self.run.ranks)
        others_display = bool(self.displaying_ranks() - {first})
        too_many = len(fold_lines(self._held)) > QUICK_LINES
        # A cell whose ranks wind down (one raised: its peers are released, the group re-formed) is
        # over for the user: its error says the rest, and it does not grow for the time that takes.
        winding_down = any(st.status in ("failed", "interrupted") for st in self.run.ranks.values())
        slow = not final and not winding_down and time.monotonic() - self._started > self._grow_after
        paused = any(st.status == "paused" for st in self.run.ranks.values())  # a debugger: its badge says where
        if others_display or too_many or slow or paused:
            self._grow()
            if final:
                self.flush(final=True)
            return
        if final:
            self._show_plainly(first)

    def _show_plainly(self, first: int) -> None:
        """A quick cell: its lines as a plain cell's stream output, folded; rank 0's rich output as the cell's."""
        import sys

        wrote = False
        for stream, text in fold_lines(self._held):
            (sys.stderr if stream == "stderr" else sys.stdout).write(text + "\n")
            wrote = True
        taken = self.take_displays()
        for rank in sorted(taken.dropped):
            sys.stderr.write(taken.dropped_note(rank, FELL_BEHIND) + "\n")
            wrote = True
        for shown in taken.events:
            if not show_in_cell(shown):
                sys.stdout.write(f"[{shown.rank}] {shown.data.get('text/plain', '<rich output>')}\n")
                wrote = True
        if not (self.run.status == "finished" and self.run.quiet_when_finished):
            sys.stdout.write(f"nbdist: {format_report_line(self.run)}  (logs: {self.run.log_dir})\n")
            wrote = True
        if wrote:  # a kernel's flush waits for its IO thread: a silent cell has nothing to wait for
            sys.stdout.flush()

    def _grow(self) -> None:
        """Become the live view: it subscribes with replay, so it shows what came before too."""
        from IPython.display import display

        from nbdist.frontend.views.widget import WidgetView

        self.grown = WidgetView(self.run)
        self._held.clear()
        self._handle = display(self.grown.widget, display_id=True)

    def _leave_summary(self) -> None:
        """The grown view's display gets a text/plain and HTML summary beside the widget."""
        if self._handle is None:
            return
        text, markup = summarize(self.run, self.grown.shown_lines())
        bundle = dict(self.grown.widget._repr_mimebundle_())
        bundle.update({"text/plain": text, "text/html": markup})
        self._handle.update(bundle, raw=True)

    def start_flusher(self) -> None:
        """``--bg``: no cell waits to draw it, so it is the live view from the start."""
        self._grow()
        self.grown.start_flusher()
