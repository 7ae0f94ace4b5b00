"""Views of a Run: the widget view (a tab per rank, badges, Kill) and the text view.

Both are thin: they subscribe to the run's events, buffer them, and draw at most ~10 times a
second. They own no lifecycle: the Kill button calls ``Run.kill()``. ipywidgets is imported only
when a widget view is made.
"""

from __future__ import annotations

import collections
import html
import sys
import threading
import time

import psutil

from nbdist.errors import RunStoppedError, WorkerFailedError
from nbdist.run.events import TERMINAL, DisplayEvent, OutputChunk, RunEvent

__all__ = ["TextView", "WidgetView", "make_view", "format_report_line"]

FLUSH_INTERVAL = 0.1  # at most ~10 updates a second per rank
MAX_VIEW_LINES = 2000  # per rank; the full log stays in the run dir
# Lines a view holds between two draws, per rank. Past it the oldest go (counted, and said where
# they were): a view that can't keep up shows the end of the output, and memory stays bounded.
MAX_BUFFERED_LINES = 4 * MAX_VIEW_LINES

BADGE_COLOURS = {
    "starting": ("#5f6368", "#eceff1"),
    "running": ("#0b57d0", "#e3ecfd"),
    "finished": ("#137333", "#e6f4ea"),
    "failed": ("#b3261e", "#fce8e6"),
    "interrupted": ("#8a5a00", "#fef3d6"),
    "killed": ("#8a5a00", "#fef3d6"),
}
SYMBOLS = {"starting": "○", "running": "●", "finished": "✓", "failed": "✗", "interrupted": "■", "killed": "■"}


def format_report_line(run) -> str:
    """One line for the end of a run: what happened, how long it took, where the logs are."""
    elapsed = (run.ended or time.monotonic()) - run.started
    if run.status == "finished":
        return f"finished: {run.nprocs} ranks in {elapsed:.1f} s"
    if isinstance(run.error, WorkerFailedError):
        return f"failed: {run.error.summary()}"
    if isinstance(run.error, RunStoppedError) and run.report is not None:
        return f"{run.status}: {run.report}"
    return f"{run.status} after {elapsed:.1f} s"


def _memory(pid) -> int:
    """Resident memory of a rank and its children (DataLoader workers count too)."""
    try:
        proc = psutil.Process(pid)
        return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
    except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError, ValueError):
        return 0


class _Buffered:
    """Collect events from the monitor thread; a flusher drains them at a bounded rate."""

    _in_cell = True  # flushed by the cell that is waiting for the run (not by a --bg thread)

    def __init__(self, run):
        self.run = run
        self._lock = threading.Lock()
        self._lines: dict[int, list[tuple[str, str]]] = collections.defaultdict(list)
        self._pending: dict[int, dict[str, str]] = collections.defaultdict(dict)
        self._dropped: collections.Counter = collections.Counter()
        self._displays: list[DisplayEvent] = []
        self._dirty_status = True
        self._ended = threading.Event()
        self._thread = None

    def on_event(self, event) -> None:
        with self._lock:
            if isinstance(event, OutputChunk):
                buffered = self._lines[event.rank]
                buffered.extend((event.stream, line) for line in event.lines)
                if len(buffered) > MAX_BUFFERED_LINES:
                    drop = len(buffered) - MAX_BUFFERED_LINES
                    del buffered[:drop]
                    self._dropped[event.rank] += drop
                self._pending[event.rank][event.stream] = event.pending
            elif isinstance(event, DisplayEvent):
                self._displays.append(event)
            elif isinstance(event, RunEvent):
                self._dirty_status = True
                if event.rank is None and event.status in TERMINAL:
                    self._ended.set()

    def take(self):
        with self._lock:
            lines, self._lines = self._lines, collections.defaultdict(list)
            dropped, self._dropped = self._dropped, collections.Counter()
            pending = {r: dict(p) for r, p in self._pending.items()}
            dirty, self._dirty_status = self._dirty_status, False
        for rank, n in dropped.items():
            lines[rank].insert(0, ("stderr", f"[nbdist: {n:,} lines not shown here, the view fell behind; "
                                             f"%dist_logs or {self.run.log_dir} has them all]"))
        return lines, pending, dirty

    def take_displays(self) -> list[DisplayEvent]:
        with self._lock:
            displays, self._displays = self._displays, []
        return displays

    def start_flusher(self) -> None:
        """Draw from a thread (for --bg, when no cell is waiting to do it)."""
        self._in_cell = False  # what is shown from a thread can't go into a cell's own output

        def loop():
            while not self._ended.wait(FLUSH_INTERVAL):
                self.flush()
            self.flush(final=True)

        self._thread = threading.Thread(target=loop, name="nbdist-view", daemon=True)
        self._thread.start()

    def flush(self, final: bool = False) -> None:
        raise NotImplementedError


class TextView(_Buffered):
    """Rank-prefixed lines for terminal IPython, nbconvert and logs. A ``\\r`` line (a tqdm bar)
    is printed once, in its final state, when it ends."""

    def __init__(self, run, stream=None):
        super().__init__(run)
        self.stream = stream or sys.stdout
        self._announced = set()
        run.subscribe(self.on_event)

    def flush(self, final: bool = False) -> None:
        lines, pending, _ = self.take()
        out = []
        for rank in sorted(lines):
            for stream, line in lines[rank]:
                out.append(f"[rank {rank}{'!' if stream == 'stderr' else ''}] {line}\n")
        for shown in self.take_displays():
            if shown.rank == self._first_rank() and self._in_cell and _show_in_cell(shown):
                continue  # rank 0's rich output is the cell's own, as it would be in the kernel
            out.append(f"[rank {shown.rank}] {shown.data.get('text/plain', '<rich output>')}\n")
        if final and not (self.run.status == "finished" and self.run.quiet_when_finished):
            out.append(f"nbdist: {format_report_line(self.run)}  (logs: {self.run.log_dir})\n")
        if out:
            self.stream.write("".join(out))
            self.stream.flush()

    def _first_rank(self) -> int:
        return min(self.run.global_rank(r) for r in self.run.ranks)


class WidgetView(_Buffered):
    """One tab per rank plus "all", with status badges, memory, elapsed time and a Kill button."""

    def __init__(self, run):
        import ipywidgets as w

        super().__init__(run)
        self.w = w
        self._ranks = sorted(run.global_rank(r) for r in run.ranks)
        self._shown: dict[int, collections.deque] = {r: collections.deque(maxlen=MAX_VIEW_LINES) for r in self._ranks}
        self._shown_all: collections.deque = collections.deque(maxlen=MAX_VIEW_LINES)
        self._appended: dict[object, int] = {}
        self._last_status_draw = 0.0
        self._showed_root = False
        out_layout = dict(max_height="320px", overflow="auto", border="1px solid #e0e0e0", padding="2px 6px")
        self.outputs = {r: w.Output(layout=w.Layout(**out_layout)) for r in self._ranks}
        self.output_all = w.Output(layout=w.Layout(**out_layout))
        self.live = {r: w.HTML(layout=w.Layout(min_height="1.4em")) for r in self._ranks}
        self.live_all = w.HTML(layout=w.Layout(min_height="1.4em"))
        self.badges = {r: w.HTML() for r in self._ranks}
        self.title = w.HTML()
        self.footer = w.HTML()
        self.kill_button = w.Button(description="Kill", icon="stop", button_style="danger",
                                    tooltip="Stop every rank and its child processes",
                                    layout=w.Layout(width="auto", min_width="80px", height="26px"))
        self.kill_button.on_click(self._on_kill)
        note = w.HTML(f"<span style='color:#5f6368;font-size:11px'>view keeps the last {MAX_VIEW_LINES} lines per "
                      f"rank; full logs: <code>{html.escape(run.log_dir)}</code></span>")
        tabs = [w.VBox([self.output_all, self.live_all])]
        tabs += [w.VBox([self.badges[r], self.outputs[r], self.live[r]]) for r in self._ranks]
        self.tabs = w.Tab(children=tabs)
        self._set_titles()
        header = w.HBox([self.title, self.kill_button],
                        layout=w.Layout(justify_content="space-between", align_items="center"))
        style = w.HTML(_VIEW_CSS, layout=w.Layout(display="none"))
        self.widget = w.VBox([style, header, self.tabs, self.footer, note], layout=w.Layout(width="100%"))
        self.widget.add_class("nbdist-view")
        self._draw_status()
        run.subscribe(self.on_event)

    # -- drawing ------------------------------------------------------------------------------
    def _set_titles(self) -> None:
        titles = ["all"] + [f"{SYMBOLS.get(self._rank_status(r).status, '')} rank {r}" for r in self._ranks]
        self.tabs.titles = tuple(titles)

    def _rank_status(self, grank):
        for r, st in self.run.ranks.items():
            if self.run.global_rank(r) == grank:
                return st
        raise KeyError(grank)

    def _badge_html(self, grank) -> str:
        st = self._rank_status(grank)
        fg, bg = BADGE_COLOURS.get(st.status, ("#333", "#eee"))
        parts = [f"<span style='background:{bg};color:{fg};border:1px solid {fg};border-radius:10px;"
                 f"padding:0 8px;font-weight:600;font-size:12px'>{st.status}</span>",
                 f"<span>rank {grank}</span>", f"<span>pid {st.pid or '-'}</span>",
                 f"<span>{st.elapsed:.1f} s</span>"]
        if st.status in TERMINAL:
            code = st.signal_name or (f"exit {st.exitcode}" if st.exitcode is not None else "")
            if code:
                parts.append(f"<span>{html.escape(code)}</span>")
        else:
            parts.append(f"<span>{_memory(st.pid) / 2**20:.0f} MiB</span>")
        return ("<div style='display:flex;gap:12px;align-items:center;font-family:var(--jp-ui-font-family,sans-serif);"
                "font-size:12px;color:#3c4043;margin:2px 0 4px'>" + "".join(parts) + "</div>")

    def _draw_status(self) -> None:
        run = self.run
        counts = collections.Counter(st.status for st in run.ranks.values())
        summary = ", ".join(f"{n} {s}" for s, n in counts.items())
        fg, bg = BADGE_COLOURS.get(run.status, ("#333", "#eee"))
        self.title.value = (
            f"<div style='font-family:var(--jp-ui-font-family,sans-serif);font-size:13px'>"
            f"<b>nbdist</b> {html.escape(run.label)} · {run.nprocs} ranks · "
            f"<span style='color:{fg};background:{bg};padding:0 6px;border-radius:8px;font-weight:600'>"
            f"{run.status}</span> <span style='color:#5f6368'>({summary})</span></div>")
        for r in self._ranks:
            self.badges[r].value = self._badge_html(r)
        self._set_titles()
        if run.done:
            # The header's badge says how it ended; a dead button (or a "Killing…" forever) would not.
            self.kill_button.disabled = True
            self.kill_button.layout.display = "none"
            colour = BADGE_COLOURS.get(run.status, ("#333", ""))[0]
            self.footer.value = (f"<div style='color:{colour};font-size:12px;margin-top:4px'>"
                                 f"{html.escape(format_report_line(run))}</div>")
            root = getattr(run.error, "rank", None)
            if root is not None and not self._showed_root and root in self._ranks:
                self._showed_root = True  # open the tab of the rank that failed first, once
                self.tabs.selected_index = 1 + self._ranks.index(root)

    def _append(self, out, deque_, lines) -> None:
        """Append in one message per stream run; rebuild from the bounded deque when too long."""
        deque_.extend(lines)
        count = self._appended.get(id(out), 0) + len(lines)
        if count > MAX_VIEW_LINES * 1.5:
            out.outputs = tuple(self._stream_outputs(list(deque_)))
            self._appended[id(out)] = len(deque_)
            return
        self._appended[id(out)] = count
        for stream, text in self._runs(lines):
            (out.append_stderr if stream == "stderr" else out.append_stdout)(text)

    @staticmethod
    def _runs(lines):
        stream, buf = None, []
        for s, line in lines:
            if s != stream and buf:
                yield stream, "".join(buf)
                buf = []
            stream = s
            buf.append(line + "\n")
        if buf:
            yield stream, "".join(buf)

    def _stream_outputs(self, lines):
        for stream, text in self._runs(lines):
            yield {"output_type": "stream", "name": stream, "text": text}

    @staticmethod
    def _live_html(text: str) -> str:
        if not text:
            return ""
        return (f"<pre style='margin:0;font-size:12px;color:#3c4043;white-space:pre;overflow:hidden'>"
                f"{html.escape(_strip_ansi(text))}</pre>")

    def flush(self, final: bool = False) -> None:
        lines, pending, dirty = self.take()
        merged = []
        for rank in sorted(lines):
            if rank in self.outputs and lines[rank]:
                self._append(self.outputs[rank], self._shown[rank], lines[rank])
                merged.extend((s, f"[{rank}] {line}") for s, line in lines[rank])
        if merged:
            self._append(self.output_all, self._shown_all, merged)
        for rank, streams in pending.items():
            if rank in self.live:
                text = streams.get("stderr") or streams.get("stdout") or ""
                value = self._live_html(text)
                if self.live[rank].value != value:
                    self.live[rank].value = value
        live_all = [f"[{r}] {p.get('stderr') or p.get('stdout')}" for r, p in sorted(pending.items())
                    if p.get("stderr") or p.get("stdout")]
        value = self._live_html("\n".join(live_all))
        if self.live_all.value != value:
            self.live_all.value = value
        for shown in self.take_displays():
            first = shown.rank == self._ranks[0]
            if not (first and self._in_cell and _show_in_cell(shown)) and shown.rank in self.outputs:
                out = self.outputs[shown.rank]  # other ranks' rich output goes into their tab
                out.outputs = (*out.outputs, {"output_type": "display_data", "data": shown.data,
                                              "metadata": shown.metadata})
        now = time.monotonic()
        if dirty or final or now - self._last_status_draw > 1.0:
            self._last_status_draw = now
            self._draw_status()

    def _on_kill(self, _button) -> None:
        self.kill_button.disabled = True
        self.kill_button.description = "Killing…"
        threading.Thread(target=self.run.kill, name="nbdist-kill", daemon=True).start()

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


# Compact tabs that size to their label; output that scrolls inside its tab.
_VIEW_CSS = """<style>
.nbdist-view .lm-TabBar-tab { flex: 0 1 auto !important; min-width: 64px !important; max-width: 130px !important;
  padding: 0 12px !important; }
.nbdist-view .jp-OutputArea-output pre { font-size: 12px; line-height: 1.35; }
</style>"""


def _show_in_cell(shown: DisplayEvent) -> bool:
    """Show a rank's MIME bundle as the cell's own output; False (nothing shown) without IPython.

    Callers try this first for rank 0 and fall back to the rank's tab or a text line.
    """
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        return False
    if get_ipython() is None:
        return False
    display(shown.data, metadata=shown.metadata, raw=True)
    return True


def _strip_ansi(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def make_view(run, kind: str = "auto"):
    """A widget view where a widget frontend may be present (a Jupyter kernel), else a text view."""
    if kind == "auto":
        try:
            from IPython import get_ipython

            shell = get_ipython()
            kind = "widget" if shell is not None and getattr(shell, "kernel", None) is not None else "text"
        except ImportError:
            kind = "text"
    if kind == "widget":
        try:
            return WidgetView(run)
        except ImportError:
            pass
    return TextView(run)
