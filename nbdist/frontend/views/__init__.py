"""Views of a run or a session cell: the widget view (a tab per rank, badges, Kill) and the text view.

Both are thin: they subscribe to the run's events, buffer them, and draw at most ~10 times a
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
            from nbdist.frontend.views.widget import WidgetView

            return WidgetView(run)
        except ImportError:
            pass
    return TextView(run)
