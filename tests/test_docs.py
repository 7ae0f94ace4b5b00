"""The documentation site builds from nothing with warnings as errors (``bash scripts/docs.sh``), and holds
what a reader comes for: the API of every public name, the magics' options generated from their
parsers, and the quickstart notebook with the outputs it printed as the site was built."""

from __future__ import annotations

import html
import inspect
import os
import re
import subprocess
import time

import pytest
from conftest import ROOT

import nbdist

HTML = os.path.join(ROOT, "docs", "_build", "html")
BUILD_S = 1500  # the notebooks are executed as the site builds (cold cache: a few minutes on 2 cores)


def _text(page: str, tag: str = " ") -> str:
    """A built page's visible text, tags (as ``tag``) and entities gone, whitespace collapsed.

    ``tag=""`` for highlighted code, whose tokens are spans side by side."""
    with open(os.path.join(HTML, page), encoding="utf-8") as fh:
        source = fh.read()
    source = re.sub(r"<(script|style)\b.*?</\1>", " ", source, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", tag, source)).split())


def _ids(page: str) -> set[str]:
    with open(os.path.join(HTML, page), encoding="utf-8") as fh:
        return set(re.findall(r'\bid="([^"]+)"', fh.read()))


@pytest.fixture(scope="module")
def site():
    """``bash scripts/docs.sh``, once for this module: a broken reference or page fails it."""
    t0 = time.monotonic()
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "docs.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=BUILD_S)
    assert proc.returncode == 0, f"docs.sh failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    print(f"\ndocs built in {time.monotonic() - t0:.0f} s")
    return HTML


def test_every_public_name_is_in_the_api_reference_source():
    """Each name of ``nbdist.__all__`` is documented by api.rst (an autodoc entry, and the summary table)."""
    with open(os.path.join(ROOT, "docs", "api.rst"), encoding="utf-8") as fh:
        source = fh.read()
    documented = set(re.findall(r"^\.\. auto(?:function|class|exception):: (?:nbdist\.)?(\w+)\s*$", source, re.M))
    summary = source.split(".. autosummary::", 1)[1].split("\n\n", 2)[1]
    listed = {line.strip() for line in summary.splitlines() if line.strip()}
    assert set(nbdist.__all__) - documented == set(), "names of nbdist.__all__ without an API entry"
    assert set(nbdist.__all__) - listed == set(), "names of nbdist.__all__ missing from the summary table"


@pytest.mark.timeout(BUILD_S + 60)
def test_the_api_reference_documents_every_public_name(site):
    ids = _ids("api.html")
    missing = [name for name in nbdist.__all__ if f"nbdist.{name}" not in ids]
    assert not missing, f"no API entry in the built site for {missing}"


@pytest.mark.timeout(BUILD_S + 60)
def test_launch_is_documented_with_every_parameter(site):
    with open(os.path.join(site, "api.html"), encoding="utf-8") as fh:
        source = fh.read()
    entry = source[source.index('id="nbdist.launch"'):source.index('id="nbdist.Run"')]
    # numpydoc writes each entry of Parameters as <dt><strong>NAME[, NAME]</strong>...
    names = {n.strip().lstrip("*") for dt in re.findall(r"<dt><strong>(.*?)</strong>", entry)
             for n in html.unescape(re.sub(r"<[^>]+>", "", dt)).split(",")}
    params = set(inspect.signature(nbdist.launch).parameters)
    assert params - names == set(), f"launch's parameters without an entry on its API page: {params - names}"


@pytest.mark.timeout(BUILD_S + 60)
def test_session_and_its_cells_methods_are_documented(site):
    ids = _ids("api.html")
    for method in ("run", "execute", "push", "pull", "scatter", "gather", "sync", "interrupt", "collectives",
                   "stacks", "wait_ready", "close", "restart"):
        assert f"nbdist.Session.{method}" in ids, f"Session.{method} is not on the API page"
    for method in ("wait", "interrupt", "kill"):
        assert f"nbdist.Run.{method}" in ids, f"Run.{method} is not on the API page"
        assert f"nbdist.session.cell_handle.CellHandle.{method}" in ids, f"CellHandle.{method} is not on the API page"


@pytest.mark.timeout(BUILD_S + 60)
def test_the_magics_options_are_generated_from_their_parsers(site):
    from nbdist.frontend.cli import _parser
    from nbdist.frontend.magics import DistributedMagics

    text = _text("magics.html")
    for magic in ("distributed", "dist_start", "dist_debug", "dist_sync"):
        parser = getattr(DistributedMagics, magic).parser
        for action in parser._actions:
            if action.option_strings and action.help and action.help != "show this help message and exit":
                assert action.option_strings[-1] in text, f"%{magic}'s {action.option_strings[-1]} is not on the page"
                assert " ".join(action.help.split()) in text, f"%{magic}'s help for {action.option_strings[-1]}"
    for name in ("dist_stop", "dist_restart", "dist_stacks", "dist_autoreload", "dist_ps", "dist_warm", "dist_kill",
                 "dist_logs"):
        assert f"%{name}" in text, f"%{name} is not on the magics page"
    cli = _parser()
    sub = next(a for a in cli._actions if a.dest == "command")
    for name, subparser in sub.choices.items():
        assert f"nbdist {name}" in text
        for action in subparser._actions:
            if action.help and action.help != "show this help message and exit":
                assert " ".join(action.help.split()) in text, f"nbdist {name}: {action.dest}'s help"


@pytest.mark.timeout(BUILD_S + 60)
def test_the_quickstart_notebook_is_rendered_with_its_outputs(site):
    page = os.path.join(site, "notebooks", "01_quickstart.html")
    with open(page, encoding="utf-8") as fh:
        source = fh.read()
    text = _text(os.path.join("notebooks", "01_quickstart.html"))
    code = _text(os.path.join("notebooks", "01_quickstart.html"), tag="")
    assert "%%distributed --nprocs 4 --pull losses" in code, "the training cell"
    assert "finished {0:" in text, "the launch cell's printed result, executed as the site was built"
    assert "no nbdist ranks are running" in text, "%dist_ps's output"
    assert re.search(r'<img[^>]+src="[^"]+\.png"', source), "the loss curve's figure"
    assert "application/vnd.jupyter.widget-state+json" in source, "the view's widget state, saved with the page"
