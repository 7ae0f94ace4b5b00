"""Every test proves it left nothing running: no new descendant and no marked process."""

from __future__ import annotations

import contextlib
import multiprocessing.resource_tracker
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from nbdist.run import processes as proctree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE_S = 5.0
# Roots of long-lived helper trees (the test browser) whose processes come and go with pages.
IGNORED_TREES: set[int] = set()
# Warm templates and store hosts that a fixture keeps across tests (this process's, a module kernel's).
# Only the helper itself is exempt: the ranks a template forks are checked like any other, by tree and marker.
KEPT_TEMPLATES: set[int] = set()


def _tracker_pid():
    return getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)


def live_descendants() -> set[int]:
    """Live, non-zombie descendants of this process, minus the long-lived helper trees."""
    out = set()
    ignored = set(IGNORED_TREES)
    for root in IGNORED_TREES:
        try:
            ignored.update(c.pid for c in psutil.Process(root).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for p in psutil.Process().children(recursive=True):
        if p.pid in ignored:
            continue
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


_TRACKER = "from multiprocessing.resource_tracker import main"


def _leftovers(before: set[int]) -> dict[int, str]:
    # multiprocessing's resource tracker is a helper of the process that launches (this one, or
    # a test kernel), started once and kept for that process's life. nbdist starts it before the
    # marked window, so it carries no marker; a tracker *with* a marker is still reported below.
    ignore = before | {_tracker_pid()} | KEPT_TEMPLATES | _own_store_host()
    left = {}
    for pid in live_descendants() - ignore:
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())
        except psutil.NoSuchProcess:
            continue
        if _TRACKER not in cmd:
            left[pid] = cmd[:120]
    for m in find_marked_leftovers():
        left[m.pid] = f"[marked {m.run_id}] {m.cmdline[:100]}"
    return left


def _own_store_host() -> set[int]:
    """This process's store host (started at the first loopback run here, kept for the process's life)."""
    hosts = sys.modules.get("nbdist.launchers.store_host")
    host = hosts.current_store_host() if hosts is not None else None
    return {host.pid} if host is not None and host.proc.poll() is None else set()


def find_marked_leftovers(run_id=None):
    """Marked processes that must not outlive a test: every rank and its children, and a warm
    template whose kernel is gone. The template of a live kernel (a kept one, or one that a
    JupyterLab kernel of the browser suite started) belongs to that kernel, which is checked itself."""
    return [m for m in proctree.find_marked(run_id)
            if m.pid not in KEPT_TEMPLATES and not (m.is_template and not m.orphaned)]


@pytest.fixture(autouse=True)
def no_process_left():
    """Record descendants before the test; fail if any new one, or any marked process, outlives it."""
    before = live_descendants()
    yield
    deadline = time.monotonic() + GRACE_S
    left = _leftovers(before)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _leftovers(before)
    if left:
        for pid in left:  # clean up by pid so one leak doesn't fail the tests after it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"processes left running {GRACE_S:.0f} s after the test: {left}")


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real single-node Slurm (munge, slurmctld, slurmd) on 127.0.0.1 for the whole session."""
    import shutil
    import tempfile

    from clusters import SlurmCluster, slurm_missing

    why = slurm_missing()
    if why:
        pytest.skip(why)
    # Not under pytest's tmp folders: munged runs as its own user and must traverse every parent.
    base = tempfile.mkdtemp(prefix="nbdist-slurm-")
    cluster = SlurmCluster.start(base)
    # The daemons outlive tests, and slurmstepd comes and goes under slurmd; ranks that srun starts
    # carry the run's marker, so the marker check still sees every one of them.
    daemons = {p.pid for p in cluster.procs}
    IGNORED_TREES.update(daemons)
    yield cluster
    cluster.stop()
    IGNORED_TREES.difference_update(daemons)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def slurm(slurm_cluster, monkeypatch):
    """srun and sinfo in this test (and the processes it starts) talk to the test cluster."""
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    return slurm_cluster


def default_sigint() -> None:
    """In a child before exec: SIGINT back to its default, so Python turns it into KeyboardInterrupt.

    The test suite may itself run with SIGINT ignored (a background job of a non-interactive shell,
    nohup, some CI agents), and an ignored signal stays ignored across exec: a test that sends
    SIGINT sets the disposition it relies on in what it starts.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def run_script(tmp_path):
    """Write a Python script and return a function that starts it (Popen, its own session)."""

    def start(source: str, *args, env=None, **popen_kw):
        path = tmp_path / f"script_{time.monotonic_ns()}.py"
        path.write_text(textwrap.dedent(source))
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        popen_kw.setdefault("preexec_fn", default_sigint)
        return subprocess.Popen(
            [sys.executable, str(path), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            cwd=str(tmp_path),
            **popen_kw,
        )

    return start


def start_parent_with_loader_ranks(run_script, ready_dir, **launch_kwargs):
    """A real parent process that launches 2 ranks with DataLoader workers and then just sleeps.

    Returns ``(proc, run_id)`` once every rank's workers are up, ready to be killed.
    """
    proc = run_script(
        f"""
        import sys, time, nbdist
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import rankfns
        if __name__ == "__main__":
            run = nbdist.launch(rankfns.sleep_with_loader, {str(ready_dir)!r}, nprocs=2, join=False,
                                init_process_group=False, **{launch_kwargs!r})
            print("RUN", run.run_id, flush=True)
            time.sleep(600)
        """
    )
    wait_for(lambda: len([f for f in os.listdir(ready_dir) if f.startswith("ready.")]) == 2, 90, what="ranks ready")
    return proc, proc.stdout.readline().split()[1]


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def began(code: str, folder) -> str:
    """``code`` that first leaves ``began.<rank>`` in ``folder`` (created here, fresh per cell), so a
    test can wait until every rank runs it: a session says nothing when a cell begins."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=False)
    return (f"__import__('pathlib').Path({str(folder)!r}, 'began.' + __import__('os').environ['RANK']).touch()\n"
            + code)


def wait_began(folder, n: int, timeout: float = 30):
    """Until ``n`` ranks began the cell that :func:`began` made."""
    wait_for(lambda: len(list(Path(folder).glob("began.*"))) >= n, timeout, what=f"the cell to begin on {n} ranks")


def marked_pids(run_id=None) -> set[int]:
    """Marked processes (of ``run_id``, or of any run), less the templates of live kernels."""
    return {m.pid for m in find_marked_leftovers(run_id)}


@pytest.fixture(scope="session")
def warm_template():
    """This test process's warm template, kept for the session (ranks forked from it are checked)."""
    import nbdist
    from nbdist.warmstart import handle as warm

    template = nbdist.warm(wait=True)
    assert template.status == "ready", template.describe()
    KEPT_TEMPLATES.add(template.pid)
    yield template
    warm.close_templates()
    KEPT_TEMPLATES.discard(template.pid)


@pytest.fixture(params=["spawn", "warm"])
def start_method(request, monkeypatch):
    """Run the test with ranks spawned, then with ranks forked from the warm template.

    The default start method of every launch in the test (and of the scripts it starts, which
    then fork from a template of their own) comes from ``NBDIST_START_METHOD``.
    """
    if request.param == "warm":
        request.getfixturevalue("warm_template")
    monkeypatch.setenv("NBDIST_START_METHOD", request.param)
    return request.param


@contextlib.contextmanager
def nbdist_kernel(start_method: str):
    """A real IPython kernel with nbdist loaded, its launches made by ``start_method``; its warm
    template and store host are kept while the kernel lives, and must end with it."""
    from kernel_client import Kernel

    k = Kernel(env=dict(os.environ, OMP_NUM_THREADS="1", NBDIST_START_METHOD=start_method))
    k.start_method = start_method
    helpers = []
    try:
        assert k.run("%load_ext nbdist").status == "ok"
        template = int(k.run("import nbdist.warmstart.handle\nnbdist.warmstart.handle.current_template().pid").result)
        helpers.append(template)
        KEPT_TEMPLATES.add(template)
        store_host = kernel_store_host(k)
        if store_host is not None:
            helpers.append(store_host)
            KEPT_TEMPLATES.add(store_host)
        if start_method == "warm":
            k.run("nbdist.warmstart.handle.current_template().wait_ready(120)")
        yield k
    finally:
        k.shutdown()
    wait_for(lambda: all(gone(pid) for pid in helpers), 5, what="the kernel's warm template and store host to end with it")
    KEPT_TEMPLATES.difference_update(helpers)


def kernel_store_host(k) -> int | None:
    """The pid of kernel ``k``'s store host, or None."""
    out = k.run("import nbdist.launchers.store_host as _sh\n_h = _sh.current_store_host()\n"
                "_h.pid if _h is not None else None").result
    return int(out) if out not in (None, "None") else None


def gone(pid: int) -> bool:
    """Exited (or a zombie waiting for its parent to reap it)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def pytest_terminal_summary(terminalreporter):
    """Say where the browser suite's screenshots are, for a person to look at."""
    shots = os.path.join(ROOT, ".artifacts", "screenshots")
    if os.path.isdir(shots) and os.listdir(shots):
        terminalreporter.write_line(f"browser screenshots: {shots} ({len(os.listdir(shots))} PNG files)")
