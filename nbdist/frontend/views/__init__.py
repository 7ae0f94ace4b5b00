"""Views of a run or a session cell: in a notebook, the view that grows with the cell (plain folded
lines for a quick cell, the widget view with a tab per rank, badges and Kill for the others); the
text view for terminals and headless runs.

All are thin: they subscribe to the run's events, buffer them, and draw at most ~10 times a
second (:mod:`.buffer`). ipywidgets is imported only when a widget view is made.
"""

from __future__ import annotations

from nbdist.frontend.views.buffer import FLUSH_INTERVAL, MAX_VIEW_LINES, format_report_line
from nbdist.frontend.views.text import TextView

__all__ = ["TextView", "WidgetView", "make_view", "format_report_line", "FLUSH_INTERVAL", "MAX_VIEW_LINES"]


def __getattr__(name):
    if name == "WidgetView":
        from nbdist.frontend.views.widget import WidgetView

        return WidgetView
    raise AttributeError(name)


def make_view(run, kind: str = "auto"):
    """In a Jupyter kernel the view that grows with the cell (``"widget"``: tabs from the start),
    else the text view."""
    if kind == "auto":
        try:
            from IPython import get_ipython

            shell = get_ipython()
            kind = "auto" if shell is not None and getattr(shell, "kernel", None) is not None else "text"
        except ImportError:
            kind = "text"
    if kind in ("auto", "widget"):
        try:
            from nbdist.frontend.views.growing import GrowingView
            from nbdist.frontend.views.widget import WidgetView

            return GrowingView(run) if kind == "auto" else WidgetView(run)
        except ImportError:  # no ipywidgets
            pass
    return TextView(run)
