"""The notebook's own cells as the kernel ran them: their source, the ``cellId`` the front end sent,
and whether they ran to their end (what ``%dist_export`` takes the notebook's definitions from).

From ``%load_ext nbdist`` on, the ``pre_run_cell`` / ``post_run_cell`` events give each cell's
raw source and number, the ``cellId`` that JupyterLab, Notebook 7 and VS Code send with each
execute request (IPython's ``ExecutionInfo.cell_id``), and whether it raised. The cells before come
from IPython's history (``history_manager.input_hist_raw``, whose last entry is the ``%load_ext``
cell), without a cellId.
"""

from __future__ import annotations

import json
import os

from nbdist.session.cell_history import NotebookCell

__all__ = ["NotebookCellRecorder", "start_recording", "stop_recording", "current_cell_id", "notebook_cells",
           "notebook_file_cells"]


class NotebookCellRecorder:
    """Listens to one shell's cell events; see the module."""

    def __init__(self, shell):
        self.shell = shell
        self.cells: dict[int, NotebookCell] = {}  # execution count -> cell, from the recorder's start
        self.current: str | None = None
        # The cells before it (the %load_ext cell is the history's last entry): IPython's history only.
        raw = list(shell.history_manager.input_hist_raw)
        for i, source in enumerate(raw):
            count = shell.execution_count - (len(raw) - 1 - i)
            if count >= 1 and source:
                self.cells[count] = NotebookCell(count, source)

    def pre_run_cell(self, info) -> None:
        self.current = getattr(info, "cell_id", None)
        if getattr(info, "store_history", True):
            count = self.shell.execution_count
            self.cells[count] = NotebookCell(count, info.raw_cell, self.current)

    def post_run_cell(self, result) -> None:
        cell = self.cells.get(result.execution_count)
        if cell is not None and not result.success:
            cell.ok = False

    def notebook_cells(self) -> list[NotebookCell]:
        """Every cell the kernel ran so far, in execution order (this one included)."""
        return [self.cells[n] for n in sorted(self.cells)]


_RECORDER: NotebookCellRecorder | None = None


def start_recording(shell) -> None:
    """At ``%load_ext nbdist``: listen to the shell's cells (once)."""
    global _RECORDER
    if _RECORDER is not None and _RECORDER.shell is shell:
        return
    stop_recording()
    _RECORDER = NotebookCellRecorder(shell)
    shell.events.register("pre_run_cell", _RECORDER.pre_run_cell)
    shell.events.register("post_run_cell", _RECORDER.post_run_cell)


def stop_recording() -> None:
    global _RECORDER
    if _RECORDER is None:
        return
    for event, fn in (("pre_run_cell", _RECORDER.pre_run_cell), ("post_run_cell", _RECORDER.post_run_cell)):
        try:
            _RECORDER.shell.events.unregister(event, fn)
        except ValueError:
            pass
    _RECORDER = None


def current_cell_id() -> str | None:
    """The ``cellId`` of the cell running now (None outside a notebook front end)."""
    return _RECORDER.current if _RECORDER is not None else None


def notebook_cells(shell) -> list[NotebookCell]:
    """The kernel's cells so far, in execution order (none where nbdist was never loaded)."""
    if _RECORDER is not None and _RECORDER.shell is shell:
        return _RECORDER.notebook_cells()
    return []


def notebook_file_cells(shell) -> tuple[str | None, dict[str, tuple[int, str]]]:
    """The notebook file this kernel runs, where the front end says it (Jupyter Server's
    ``JPY_SESSION_NAME``, VS Code's ``__vsc_ipynb_file__``), and its code cells as saved: ``{cellId:
    (position, source)}``. ``(None, {})`` when there is none or it can't be read."""
    path = shell.user_ns.get("__vsc_ipynb_file__") or os.environ.get("JPY_SESSION_NAME")
    if not path or not str(path).endswith(".ipynb") or not os.path.isfile(path):
        return None, {}
    try:
        with open(path, encoding="utf-8") as fh:
            nb = json.load(fh)
    except (OSError, ValueError):
        return None, {}
    cells = {}
    for position, cell in enumerate(c for c in nb.get("cells", []) if c.get("cell_type") == "code"):
        source = cell.get("source", "")
        if cell.get("id"):
            cells[cell["id"]] = (position, "".join(source) if isinstance(source, list) else source)
    return path, cells
