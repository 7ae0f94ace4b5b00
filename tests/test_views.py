"""The default view grows with the cell, through a real kernel: a quick cell shows its lines as a plain
cell would (folded across ranks, no widget); a longer one grows into the live tabs, keeping every line,
and leaves a text/plain and HTML summary for frontends that don't render widgets."""

from __future__ import annotations

import pytest
from conftest import nbdist_kernel

WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(params=["warm"])
def kernel(request):
    with nbdist_kernel(request.param) as k:
        # Quick cells stay plain within 3 s here, not 0.5 s: a busy 2-core box may take longer than
        # that for a cell that prints three lines (seen in the browser suite on CI).
        assert k.run("%env NBDIST_GROW_AFTER_S=3\n%dist_start -n 3").status == "ok"
        assert k.run("%%distributed\nimport os, sys, time\nrank = int(os.environ['RANK'])").status == "ok"
        yield k
        k.run("%dist_stop")


def _run_counting_widgets(kernel, code):
    opened = []
    res = kernel.collect(kernel.send(code), on_message=lambda m: m["msg_type"] == "comm_open" and opened.append(m))
    return res, len(opened)


def test_a_quick_cell_shows_its_lines_as_a_plain_cell_folded_across_ranks(kernel):
    res, widgets = _run_counting_widgets(
        kernel, "%%distributed\nprint('saved')\nprint('loss', 0.5 if rank < 2 else 0.7)\n"
                "print('warned', file=sys.stderr)\nrank * 10")
    assert res.status == "ok" and res.result == "0", res.error_text
    assert res.stdout.splitlines() == ["[0-2] saved", "[0-1] loss 0.5", "[2] loss 0.7"], res.stdout
    assert res.stderr.strip() == "[0-2] warned", res.stderr
    assert widgets == 0 and not any(WIDGET in d for d in res.displays), "a quick cell leaves no widget model"


def test_a_quick_failing_cell_shows_its_lines_and_the_error(kernel):
    res, widgets = _run_counting_widgets(kernel, "%%distributed\nprint('before')\nif rank == 1:\n"
                                                 "    raise ValueError('bad shard')")
    assert res.status == "error" and "ValueError: bad shard" in res.error_text and "[0-2] before" in res.stdout
    assert widgets == 0


def test_a_longer_cell_grows_into_tabs_keeping_its_lines_and_leaves_a_summary(kernel):
    res, widgets = _run_counting_widgets(kernel, "%%distributed\nprint('early', rank)\ntime.sleep(3.5)\n"
                                                 "print('late', rank)")
    assert res.status == "ok", res.error_text
    assert widgets > 0 and any(WIDGET in d for d in res.displays), "the cell grew into the live view"
    texts = "\n".join(res.widget_text())
    for rank in range(3):
        assert f"early {rank}" in texts and f"late {rank}" in texts, "nothing shown before it grew is lost"
    assert "[0-2]" not in res.stdout and "early" not in res.stdout, "the lines are in the view only"
    summaries = [d for d in res.updates if WIDGET in d and "text/plain" in d]
    assert summaries, res.updates
    text, markup = summaries[-1]["text/plain"], summaries[-1]["text/html"]
    assert text.startswith("nbdist session") and "[0] late 0" in text and "logs:" in text, text
    assert "late 2" in markup, markup


def test_many_lines_grow_into_tabs_at_once(kernel):
    res, widgets = _run_counting_widgets(kernel, "%%distributed\nfor i in range(30):\n    print('step', i, rank)")
    assert res.status == "ok" and widgets > 0, res.stdout
    assert "step 29 2" in "\n".join(res.widget_text())
