"""The widget view: a tab per rank plus "all", status badges with elapsed time, exit code or signal
and memory, and a Kill button (ipywidgets). Only drawing lives here: what it shows of a rank's
process comes from :mod:`.probes`, and rank 0's rich output goes to the cell through :mod:`.cell_output`."""

from __future__ import annotations

import collections
import html
import threading
import time

from nbdist.frontend.views.buffer import FELL_BEHIND, MAX_VIEW_LINES, BufferedView, format_report_line
from nbdist.frontend.views.cell_output import show_in_cell, strip_ansi
from nbdist.frontend.views.probes import rank_memory
from nbdist.run.display_backlog import RECORD_DISPLAYS
from nbdist.run.events import TERMINAL

__all__ = ["WidgetView", "BADGE_COLOURS", "SYMBOLS"]

BADGE_COLOURS = {
    "starting": ("#5f6368", "#eceff1"),
    "running": ("#0b57d0", "#e3ecfd"),
    "paused": ("#6a1b9a", "#f3e5f5"),  # stopped in the debugger, waiting for a command
    "finished": ("#137333", "#e6f4ea"),
    "failed": ("#b3261e", "#fce8e6"),
    "interrupted": ("#8a5a00", "#fef3d6"),
    "killed": ("#8a5a00", "#fef3d6"),
}
SYMBOLS = {"starting": "○", "running": "●", "paused": "‖", "finished": "✓", "failed": "✗", "interrupted": "■", "killed": "■"}


class WidgetView(BufferedView):
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
        # A rank's rich output: one small Output widget per bundle, so a new one is appended (the
        # box's children travel as model ids) and nothing shown is sent again; the last
        # RECORD_DISPLAYS per rank stay, the older are closed.
        self.display_boxes = {r: w.VBox() for r in self._ranks}
        self.display_notes = {r: w.HTML() for r in self._ranks}
        self._tab_displays: dict[int, collections.deque] = {r: collections.deque() for r in self._ranks}
        self._tab_hidden: collections.Counter = collections.Counter()
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
        tabs += [w.VBox([self.badges[r], self.outputs[r], self.live[r], self.display_notes[r], self.display_boxes[r]])
                 for r in self._ranks]
        self.tabs = w.Tab(children=tabs)
        self._set_titles()
        header = w.HBox([self.title, self.kill_button],
                        layout=w.Layout(justify_content="space-between", align_items="center"))
        style = w.HTML(_VIEW_CSS, layout=w.Layout(display="none"))
        self.widget = w.VBox([style, header, self.tabs, self.footer, note], layout=w.Layout(width="100%"))
        self.widget.add_class("nbdist-view")
        self._draw_status()
        run.subscribe(self.on_event)

    def shown_lines(self) -> dict:
        """rank -> the ``(stream, line)`` pairs the view holds (its last ones)."""
        return {r: list(lines) for r, lines in self._shown.items()}

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
        if st.status == "paused" and st.where:
            parts.append(f"<span>at {html.escape(st.where)}</span>")
        if st.status in TERMINAL:
            code = st.signal_name or (f"exit {st.exitcode}" if st.exitcode is not None else "")
            if code:
                parts.append(f"<span>{html.escape(code)}</span>")
        else:
            parts.append(f"<span>{rank_memory(st.pid) / 2**20:.0f} MiB</span>")
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
                f"{html.escape(strip_ansi(text))}</pre>")

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
        self._draw_displays()
        now = time.monotonic()
        if dirty or final or now - self._last_status_draw > 1.0:
            self._last_status_draw = now
            self._draw_status()

    def _draw_displays(self) -> None:
        """Rank 0's rich output into the cell (as the kernel would show it), the others' into their tab."""
        taken = self.take_displays()
        for rank in sorted(taken.dropped):
            if rank in self.outputs:
                self._append(self.outputs[rank], self._shown[rank], [("stderr", taken.dropped_note(rank, FELL_BEHIND))])
        by_rank = collections.defaultdict(list)
        for shown in taken.events:
            first = shown.rank == self._ranks[0]
            if not (first and self._in_cell and show_in_cell(shown)) and shown.rank in self.outputs:
                by_rank[shown.rank].append(shown)
        for rank, events in by_rank.items():
            self._append_to_tab(rank, events)

    def _append_to_tab(self, rank: int, events) -> None:
        kept = self._tab_displays[rank]
        for shown in events[-RECORD_DISPLAYS:]:
            bundle = {"output_type": "display_data", "data": shown.data, "metadata": shown.metadata}
            kept.append(self.w.Output(outputs=(bundle,)))
        hidden = max(0, len(events) - RECORD_DISPLAYS)  # never drawn: not sent at all
        while len(kept) > RECORD_DISPLAYS:
            kept.popleft().close()  # its model goes from the kernel and the page
            hidden += 1
        self.display_boxes[rank].children = tuple(kept)
        if hidden:
            self._tab_hidden[rank] += hidden
            self.display_notes[rank].value = (
                f"<span style='color:#5f6368;font-size:11px'>this tab keeps rank {rank}'s last {RECORD_DISPLAYS} "
                f"displays; {self._tab_hidden[rank]:,} earlier not shown</span>")

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


