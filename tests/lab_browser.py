"""A real JupyterLab in headless Chromium, for the browser tests and the notebook benchmark.

Needs Debian's ``chromium``, and ``playwright`` and ``jupyterlab`` from PyPI. Playwright drives
/usr/bin/chromium; ``playwright install`` is never run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.request

import nbformat
import psutil
from conftest import wait_for

__all__ = ["CHROMIUM", "missing_for_lab", "running_lab", "Notebook"]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def missing_for_lab() -> str | None:
    """Why a lab can't run here, or None."""
    if not os.path.exists(CHROMIUM):
        return "Debian's chromium is not installed (apt-get install chromium)"
    for module in ("playwright", "jupyterlab"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install {module})"
    return None


@contextlib.contextmanager
def running_lab(home, root, on_browser_pids=lambda pids: None):
    """JupyterLab serving ``root`` (its settings under ``home``) and a headless Chromium.

    Yields ``{"base", "token", "root", "api", "browser"}``; ``on_browser_pids`` is told the pids of the
    browser's own processes (they come and go with pages; they are not a run's processes).
    """
    home, root = str(home), str(root)
    settings = os.path.join(home, "settings", "@jupyterlab", "apputils-extension")
    os.makedirs(settings, exist_ok=True)
    with open(os.path.join(settings, "notification.jupyterlab-settings"), "w") as fh:
        json.dump({"fetchNews": "false", "checkForUpdates": False}, fh)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "nbdist-browser-test"
    env = dict(os.environ, HOME=home, JUPYTER_CONFIG_DIR=os.path.join(home, "config"),
               JUPYTER_RUNTIME_DIR=os.path.join(home, "runtime"), JUPYTERLAB_SETTINGS_DIR=os.path.join(home, "settings"),
               JUPYTERLAB_WORKSPACES_DIR=os.path.join(home, "workspaces"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0"]
    if os.getuid() == 0:
        cmd.append("--allow-root")
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(home, "lab.log"), "wb"))
    base = f"http://127.0.0.1:{port}"

    def api(path, method="GET"):
        req = urllib.request.Request(f"{base}{path}", method=method, headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def up():
        try:
            return api("/api/status") is not None
        except OSError:
            return False

    try:
        wait_for(up, 60, interval=0.2, what="jupyter lab to answer")
        from playwright.sync_api import sync_playwright

        before = {p.pid for p in psutil.Process().children(recursive=True)}
        pw = sync_playwright().start()
        try:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            on_browser_pids({p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before})
            try:
                yield {"base": base, "token": token, "root": root, "api": api, "browser": browser}
            finally:
                browser.close()
        finally:
            pw.stop()
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


class Notebook:
    """One notebook open in JupyterLab, with its cells run the way a person runs them."""

    def __init__(self, lab, name, cells, shots=None):
        self.lab, self.name, self.shots = lab, name, shots
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, os.path.join(lab["root"], f"{name}.ipynb"))
        self.page = lab["browser"].new_page(viewport={"width": 1280, "height": 900})
        # A workspace of its own, reset: JupyterLab must not reopen an earlier notebook.
        self.page.goto(f"{lab['base']}/lab/workspaces/{name}/tree/{name}.ipynb?reset&token={lab['token']}")
        self.cell(0).wait_for(timeout=60_000)
        wait_for(self._kernel_idle, 60, interval=0.2, what="the notebook's kernel to be idle")
        self.shot_no = 0

    def _kernel_idle(self):
        sessions = [s for s in self.lab["api"]("/api/sessions") if s["path"].endswith(f"{self.name}.ipynb")]
        return sessions and sessions[0]["kernel"]["execution_state"] == "idle"

    def cell(self, i):
        return self.page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell").nth(i)

    def output(self, i):
        return self.cell(i).locator(".jp-Cell-outputArea")

    def run(self, i):
        self.cell(i).locator(".jp-InputArea-editor").click()
        self.page.keyboard.press("Shift+Enter")

    def run_all(self):
        """Select every cell (command mode) and run them, as Run All does."""
        self.cell(0).locator(".jp-InputArea-editor").click()
        self.page.keyboard.press("Escape")
        self.page.keyboard.press("Control+a")
        self.page.keyboard.press("Shift+Enter")

    def is_done(self, i) -> bool:
        """The cell's prompt shows a number (not "*") once it has run. (Its text, not its rendered
        text: a cell scrolled far out of view is not rendered in JupyterLab's default windowing.)"""
        return (self.cell(i).locator(".jp-InputArea-prompt").text_content() or "").strip() not in ("", "[*]:", "[ ]:")

    def wait_done(self, i, timeout=120):
        wait_for(lambda: self.is_done(i), timeout, interval=0.2, what=f"cell {i} to finish")

    def shot(self, step):
        self.shot_no += 1
        path = os.path.join(self.shots, f"{self.name}-{self.shot_no:02d}-{step}.png")
        self.page.screenshot(path=path, full_page=True)
        return path

    def close(self):
        self.page.close()
        for s in self.lab["api"]("/api/sessions"):
            self.lab["api"](f"/api/sessions/{s['id']}", method="DELETE")
