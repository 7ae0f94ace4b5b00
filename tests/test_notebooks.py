"""Notebooks executed headless by nbclient, widget state saved, as CI and users run them."""

from __future__ import annotations

import os

import nbformat
import pytest
from conftest import ROOT, marked_pids
from nbclient.exceptions import CellExecutionError

from nbdist.frontend.notebook_runner import execute_notebook


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
    # --view widget: a cell on warm ranks can end before the default view would grow (0.5 s; a warm
    # one-shot cell takes about 0.1 s), and what is saved of the widget is the point here.
    path = _notebook(tmp_path, "%load_ext nbdist",
                     "%%distributed -n 2 --view widget\nimport os\nprint('hello from rank', os.environ['RANK'])")
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
    ps_text = "".join(o.get("text", "") for o in code[-1].outputs)
    assert "no nbdist ranks are running" in ps_text and "warm template pid" in ps_text, ps_text


@pytest.mark.parametrize("name", ["02_failures_and_interrupts", "03_launch_api", "04_multinode", "05_sessions",
                                  "06_debugging", "07_healing", "08_export"])
def test_doc_notebooks_run(name, tmp_path):
    nb = execute_notebook(os.path.join(ROOT, "notebooks", f"{name}.ipynb"), str(tmp_path / f"{name}.ipynb"),
                          timeout=300, cwd=str(tmp_path))
    text = "\n".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) + "\n".join(o.get("traceback", []))
                     for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    if name == "02_failures_and_interrupts":
        assert "rank 1 failed first" in text and "FileNotFoundError" in text
        assert "timed out after 6 s" in text and "wait_for_a_message_that_never_comes" in text
        assert "2 ranks stopped" in text and "no nbdist ranks are running" in text
    elif name == "03_launch_api":
        assert "{0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0}" in text
        assert "first to fail: 1" in text and "results kept: {0: 'ok'}" in text
    elif name == "05_sessions":
        values = [o["data"]["text/plain"] for c in nb.cells if c.cell_type == "code" and "train(40)" in c.source
                  for o in c.outputs if o.get("output_type") == "execute_result"]
        assert len(values) == 2 and float(values[1]) < float(values[0]), f"the same model trains on: {values}"
        assert "idle again, their state kept" in text, "the stopped loop kept the ranks and their state"
        assert "rank 1 failed first" in text and "corrupt shard on rank 1" in text
        assert "re-formed in place" in text, "the peer left in DDP's all-reduce was released, the group re-formed"
        assert "===== rank 0" in text and "===== rank 1" in text, "%dist_stacks shows every rank"
        assert "__0_0.distcp" in text and "__1_0.distcp" in text, "FSDP2's sharded checkpoint, one file per rank"
        assert "stopped (2 ranks)" in text and "no nbdist ranks are running" in text
    elif name == "06_debugging":
        assert "all_reduce #1 float32[4] on the default group -> done" in text, "the recorder"
        assert "rank 0: all_reduce #3 float32[3] on the default group, waiting" in text, text
        assert "rank 1: broadcast #3 float32[3] from rank 1 on the default group, waiting" in text
        assert "the ranks called different collectives" in text and "[2.0, 2.0]" in text
        assert "collective: barrier #" in text and "collective: none open" in text, "%dist_stacks"
        assert "rank 0: all_reduce float32[4]; rank 1: all_reduce float32[5]" in text and "[2.0, 2.0, 2.0, 2.0]" in text
        assert "this cell has no stdin" in text and "went on 1 10" in text, "headless: the breakpoint goes on"
        assert "ValueError: bad factor -1" in text and "%dist_debug needs a stdin" in text
        assert "stopped (2 ranks)" in text
    elif name == "07_healing":
        assert "rank 2 failed first: killed by SIGKILL" in text and "keep their state" in text, text
        assert "rank 2 was killed by SIGKILL" in text and "this cell needs it" in text, "%dist_ps, the refused cell"
        assert "rank 3:" in text and "bytes saved" in text
        assert "healed rank 2 from rank 0" in text and "rank-specific, not copied" in text, text
        for r in range(4):
            assert f"rank {r}: loss" in text and f"replicas equal: True, sampler reads rank {r}" in text, text
    elif name == "08_export":
        said = [line for line in text.splitlines() if line.startswith("[rank") or line.startswith(("step", "checksum"))]
        checksums = [line.split("checksum", 1)[1].strip() for line in text.splitlines() if "checksum" in line
                     and not line.lstrip().startswith(("print", "#"))]
        assert "wrote job.py" in text and "it failed" in text and "exit code 0" in text, text
        assert len(checksums) >= 2 and len(set(checksums)) == 1, f"the job's checksum is the session's: {checksums}"
        assert said, text
    else:
        assert "world of 4" in text and "world of 2" in text
        assert "{0: (0, 4), 1: (1, 4), 2: (2, 4), 3: (3, 4)}" in text, "launcher='mpirun'"
    assert not marked_pids()
