"""The package a person installs: the built wheel carries the license and the metadata, and a fresh
venv with only that wheel (and torch) runs ``%load_ext nbdist`` and a ``%%distributed`` cell in a
real IPython kernel."""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from conftest import ROOT, gone, wait_for

import nbdist

# torch pinned as setup.sh pins it: that is the local CPU wheel. A bare "torch" could download a
# CUDA build of several GB.
TORCH = "torch==2.13.0"


def _clean_env() -> dict:
    """This environment without what would put the checkout on sys.path (PYTHONPATH, an active venv)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _pip_quiet(python: str, *args: str, cwd, timeout: float) -> None:
    # Not from the checkout: `python -m pip` puts its cwd on sys.path, where the editable install's
    # nbdist.egg-info would read as "nbdist is already installed".
    proc = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, env=_clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """The wheel of this checkout, built as a release is (pip wheel, the venv's setuptools, no network)."""
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), ROOT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("nbdist-*.whl")
    return str(path)


def _metadata(wheel_path: str) -> tuple[email.message.Message, list[str]]:
    with zipfile.ZipFile(wheel_path) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(z.read(meta)), names


@pytest.mark.timeout(300)
def test_wheel_holds_the_license_and_the_metadata(wheel):
    meta, names = _metadata(wheel)
    licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert licenses, f"no LICENSE in the wheel: {names[-8:]}"
    with zipfile.ZipFile(wheel) as z:
        text = z.read(licenses[0]).decode()
    assert "BSD 3-Clause License" in text and "Copyright (c) 2026, the nbdist developers" in text
    assert meta["Version"] == nbdist.__version__, "one source for the version: nbdist.__version__"
    assert meta["License-Expression"] == "BSD-3-Clause"
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Source", "Issues", "Changelog"} <= set(urls), urls
    classifiers = meta.get_all("Classifier")
    assert "Framework :: Jupyter" in classifiers and "Topic :: System :: Distributed Computing" in classifiers
    assert any(n == "nbdist/worker/__main__.py" for n in names), "the worker the engines start is packaged"


@pytest.mark.timeout(600)
def test_wheel_in_a_fresh_venv_runs_a_distributed_cell(wheel, tmp_path, monkeypatch):
    from kernel_client import Kernel

    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)  # the interpreter beneath .venv, not .venv itself
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    try:
        _pip_quiet(python, TORCH, "numpy", wheel, "ipykernel", cwd=tmp_path, timeout=400)
        # The fresh venv's own kernel spec, found first: the kernel runs that venv's python and nothing of
        # .venv. Its cwd is an empty folder, so `import nbdist` can't find this checkout either.
        subprocess.run([python, "-m", "ipykernel", "install", "--prefix", str(venv), "--name", "python3"],
                       check=True, capture_output=True, timeout=120, cwd=tmp_path, env=_clean_env())
        monkeypatch.setenv("JUPYTER_PATH", str(venv / "share" / "jupyter"))
        work = tmp_path / "work"
        work.mkdir()
        monkeypatch.chdir(work)
        env = _clean_env()
        env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1")
        k = Kernel(env=env)
        helpers = []
        try:
            found = k.run("import sys, nbdist, importlib.metadata as md\n"
                          "(sys.executable, nbdist.__file__, md.version('nbdist'))")
            where = found.result or ""
            assert str(venv) in where and "site-packages/nbdist/__init__.py" in where, found
            assert repr(nbdist.__version__) in where, where
            assert k.run("%load_ext nbdist").status == "ok"
            helpers = [int(x) for x in k.run(
                "import nbdist.warmstart.handle as _w, nbdist.launchers.store_host as _s\n"
                "[h.pid for h in (_w.current_template(), _s.current_store_host()) if h is not None]").result
                       .strip("[]").split(",") if x.strip()]
            res = k.run("%%distributed --nprocs 2\nimport torch, torch.distributed as dist\n"
                        "t = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\n"
                        "print('rank', dist.get_rank(), 'of', dist.get_world_size())\nt.item()", timeout=240)
            assert res.status == "ok", res.error_text or res.stderr
            assert res.result == "3.0", res
            text = res.stdout + "".join(res.widget_text())
            assert "rank 0 of 2" in text and "rank 1 of 2" in text, text
        finally:
            k.shutdown()
        wait_for(lambda: all(gone(pid) for pid in helpers), 10, what="the kernel's helpers to end with it")
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # about 1 GB with torch
