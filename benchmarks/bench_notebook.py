"""A notebook of small session cells against the same notebook of plain cells, in a real JupyterLab.

    .venv/bin/python benchmarks/bench_notebook.py [--cells 300] [--nprocs 2]

Two notebooks, run one after the other in the same JupyterLab and headless Chromium (the browser
suite's, tests/lab_browser.py), each with Run All: ``--cells`` session cells that print one line
per rank (``%%distributed``, the default view, in a live ``%dist_start`` session), and as many
plain cells that print the lines the quick view shows for them (``[0-1] step 7``). For each: the
time from Run All until the last cell has run and shows its line, the page's DOM nodes and JS heap
after a garbage collection, the kernel's RSS and its live widget models. Prints both and their
ratios; it asserts nothing (goals, not tests).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

MEASURE = ("import os, psutil, ipywidgets.widgets.widget as w\n"
           "print('kernel', psutil.Process().memory_info().rss, len(w._instances))")


def _notebook_cells(kind: str, cells: int, nprocs: int) -> list[str]:
    ranks = f"[0-{nprocs - 1}]" if nprocs > 1 else "[0]"
    if kind == "plain":
        return [f"print('{ranks} step', {i})" for i in range(cells)] + [MEASURE]
    return (["%load_ext nbdist\nimport nbdist.frontend.session_magics", f"%dist_start -n {nprocs}\nnbdist.frontend.session_magics.live_session().wait_ready(120)"]
            + [f"%%distributed\nprint('step', {i})" for i in range(cells)] + [MEASURE, "%dist_stop"])


def _measure(lab, kind: str, cells: int, nprocs: int) -> dict:
    from conftest import wait_for
    from lab_browser import Notebook

    source = _notebook_cells(kind, cells, nprocs)
    nb = Notebook(lab, f"bench-{kind}", source)
    try:
        last = source.index(MEASURE) - 1
        if kind == "session":  # the session up first: its start is not what this measures
            nb.run(0), nb.wait_done(0), nb.run(1), nb.wait_done(1, timeout=120)
            first = 2
        else:
            first = 0
        nb.cell(first).locator(".jp-InputArea-editor").click()
        nb.page.keyboard.press("Escape")
        t0 = time.perf_counter()
        # Run from `first` to the end: select it and everything below, then run the selection.
        nb.page.keyboard.press("Shift+End" if first else "Control+a")
        nb.page.keyboard.press("Shift+Enter")
        wait_for(lambda: nb.is_done(last) and f"step {cells - 1}" in (nb.output(last).text_content() or ""), 600,
                 interval=0.05, what=f"the last of {cells} cells to show its line")
        seconds = time.perf_counter() - t0
        wait_for(lambda: nb.is_done(last + 1), 60, interval=0.1, what="the measuring cell")
        rss, widgets = nb.output(last + 1).text_content().split()[1:3]
        cdp = nb.page.context.new_cdp_session(nb.page)
        cdp.send("HeapProfiler.collectGarbage")
        heap = cdp.send("Runtime.getHeapUsage")["usedSize"]
        dom = nb.page.evaluate("document.getElementsByTagName('*').length")
        if kind == "session":
            nb.wait_done(last + 2, timeout=60)  # %dist_stop
        return {"seconds": seconds, "dom": dom, "heap_mb": heap / 2**20, "rss_mb": int(rss) / 2**20,
                "widgets": int(widgets)}
    finally:
        nb.close()


def main() -> None:
    from lab_browser import missing_for_lab, running_lab

    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=int, default=300)
    parser.add_argument("--nprocs", type=int, default=2)
    args = parser.parse_args()
    reason = missing_for_lab()
    if reason:
        sys.exit(f"bench_notebook: {reason}")
    with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as root:
        with running_lab(home, root) as lab:
            rows = {kind: _measure(lab, kind, args.cells, args.nprocs) for kind in ("plain", "session")}
    plain, session = rows["plain"], rows["session"]
    print(f"{args.cells} cells, Run All in JupyterLab (headless Chromium), {args.nprocs}-rank session, default view")
    print(f"  {'':<24}{'plain cells':>14}{'session cells':>16}{'ratio':>8}")
    for key, label, fmt in (("seconds", "time to run and show", "{:.1f} s"), ("dom", "DOM nodes", "{:d}"),
                            ("heap_mb", "JS heap after GC", "{:.1f} MB"), ("rss_mb", "kernel RSS", "{:.0f} MB"),
                            ("widgets", "widget models (kernel)", "{:d}")):
        ratio = f"{session[key] / plain[key]:.2f}x" if plain[key] else "-"
        print(f"  {label:<24}{fmt.format(plain[key]):>14}{fmt.format(session[key]):>16}{ratio:>8}")
    print(f"  goal: session/plain time <= 2x: {'met' if session['seconds'] <= 2 * plain['seconds'] else 'missed'}")


if __name__ == "__main__":
    main()
