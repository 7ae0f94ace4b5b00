"""Rich output from a session rank: ``display(...)`` and ``plt.show()`` reach the notebook.

A rank has no frontend: its stdout is a log file. While a session cell runs, this module routes
IPython's ``display`` and matplotlib's ``show`` to the session channel as MIME bundles (the same
``{"image/png": ..., "text/html": ...}`` a kernel would send); the kernel shows rank 0's in the
cell's output and the other ranks' in their tabs. Outside a cell (or outside a session) display
falls back to printing the text form, into the rank's log.

Also a matplotlib backend: ``module://nbdist.worker.display`` (Agg that publishes on ``show``).
"""

from __future__ import annotations

import base64
import io
import os
import sys

__all__ = ["install", "display", "publish"]

_SEND = None  # callable(data, metadata), set while a session cell runs
_FORMATTER = None
BACKEND = "module://nbdist.worker.display"


def install(send) -> None:
    """Route this rank's display() and plt.show() to ``send(data, metadata)``.

    Called by the session loop once, at its start: IPython's display modules are imported and
    patched then, so a cell's own ``from IPython.display import display`` gets this one. The loop's
    ``send`` itself prints into the log between cells.
    """
    global _SEND
    _SEND = send
    import importlib

    for name in ("IPython.core.display_functions", "IPython.core.display", "IPython.display"):
        try:
            importlib.import_module(name).display = display
        except ImportError:  # no IPython on this rank: plt.show() still works
            break
    # The kernel's own MPLBACKEND (matplotlib-inline) means nothing on a rank: ours publishes.
    os.environ["MPLBACKEND"] = BACKEND
    mpl = sys.modules.get("matplotlib")
    if mpl is not None:
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None:
            if pyplot.get_backend() != BACKEND:
                pyplot.switch_backend(BACKEND)
        else:  # sets the rc only (mpl.get_backend() would import pyplot: 0.2 s of every rank's start)
            mpl.use(BACKEND)


def publish(data: dict, metadata: dict | None = None) -> None:
    """Send one MIME bundle to the notebook (or print its text form when no cell is listening)."""
    if _SEND is not None:
        _SEND(data, metadata or {})
    else:
        print(data.get("text/plain", "<rich output>"))


def _format(obj) -> tuple[dict, dict]:
    global _FORMATTER
    try:
        from IPython.core.formatters import DisplayFormatter
    except ImportError:
        return {"text/plain": repr(obj)}, {}
    if _FORMATTER is None:
        _FORMATTER = DisplayFormatter()
    data, metadata = _FORMATTER.format(obj)
    return data, metadata


def display(*objs, raw: bool = False, metadata=None, **kwargs) -> None:
    """IPython's ``display`` on a rank: each object becomes one MIME bundle for the notebook."""
    for obj in objs:
        if raw:
            publish(obj, metadata)
        else:
            data, md = _format(obj)
            publish(data, {**md, **(metadata or {})})


def _show_figures() -> None:
    import matplotlib.pyplot as plt

    for num in plt.get_fignums():
        fig = plt.figure(num)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        publish({"image/png": base64.b64encode(buf.getvalue()).decode("ascii"), "text/plain": repr(fig)})
    plt.close("all")


try:  # the backend half: only where matplotlib is installed
    from matplotlib.backend_bases import _Backend
    from matplotlib.backends.backend_agg import _BackendAgg

    @_Backend.export
    class _BackendNbdist(_BackendAgg):
        @staticmethod
        def show(*args, **kwargs):
            _show_figures()
except ImportError:  # pragma: no cover - no matplotlib: display() still works
    pass
