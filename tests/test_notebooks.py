"""Notebooks executed headless by nbclient, widget state saved, as CI and users run them."""

from __future__ import annotations

import os

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError

from conftest import ROOT, marked_pids
from nbdist.notebook import execute_notebook


def _widget_models(nb, name):
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    return [m["state"] for m in state.values() if m["model_name"] == name]


def _notebook(tmp_path, *cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    return str(path)


def test_saved_widget_state_holds_each_ranks_output(tmp_path):
    path = _notebook(tmp_path, "%load_ext nbdist",
                     "%%distributed -n 2\nimport os\nprint('hello from rank', os.environ['RANK'])")
    nb = execute_notebook(path, timeout=180)
    texts = ["".join(o.get("text", "") for o in s.get("outputs", [])) for s in _widget_models(nb, "OutputModel")]
    assert "hello from rank 0\n" in texts and "hello from rank 1\n" in texts, texts
    assert any("[0] hello from rank 0" in t and "[1] hello from rank 1" in t for t in texts)
    titles = [s.get("titles") for s in _widget_models(nb, "TabModel")]
    assert ["all", "✓ rank 0", "✓ rank 1"] in [list(t) for t in titles if t]


def test_a_failing_cell_stops_the_notebook_like_any_failing_cell(tmp_path):
    path = _notebook(tmp_path, "%load_ext nbdist", "%%distributed -n 2\nraise RuntimeError('nope')", "print('never')")
    with pytest.raises(CellExecutionError) as info:
        execute_notebook(path, timeout=180)
    assert "WorkerFailedError" in str(info.value) and "RuntimeError: nope" in str(info.value)
    assert not marked_pids()


def test_quickstart_notebook(tmp_path):
    out = tmp_path / "01_quickstart.ipynb"
    nb = execute_notebook(os.path.join(ROOT, "notebooks", "01_quickstart.ipynb"), str(out), timeout=600)
    code = [c for c in nb.cells if c.cell_type == "code"]
    train = next(c for c in code if c.source.startswith("%%distributed"))
    result = next(o for o in train.outputs if o.output_type == "execute_result")
    assert 0 < float(result.data["text/plain"]) < 1.0, "the loss went down"
    plot = next(c for c in code if "plt.show()" in c.source)
    assert any("image/png" in o.get("data", {}) for o in plot.outputs), "the loss curve is plotted"
    assert any("finished {0:" in o.get("text", "") for o in plot.outputs)
    rank0 = ["".join(o.get("text", "") for o in s.get("outputs", [])) for s in _widget_models(nb, "OutputModel")]
    bars = [line for t in rank0 for line in t.splitlines() if "training:" in line and not line.startswith("[")]
    assert len(bars) == 1 and "80/80" in bars[0], bars
    assert "no nbdist processes are running" in "".join(o.get("text", "") for o in code[-1].outputs)
