"""Bad input fails before any process starts; ps/kill/CLI find leftovers by marker only; the core stays IPython-free."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest
from conftest import KEPT_TEMPLATES, ROOT, live_descendants, marked_pids, wait_for

import nbdist
from nbdist.errors import LaunchConfigError
from nbdist.options import WorldOptions
from nbdist.protocol.world import detect_world


def _children():
    # Not the session's helpers (the test Slurm's daemons), nor the kernel's resource tracker,
    # nor this process's warm template, which the session keeps.
    out = []
    for pid in live_descendants() - KEPT_TEMPLATES:
        try:
            if "resource_tracker" not in " ".join(psutil.Process(pid).cmdline()):
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nprocs": 0}, "nprocs must be an int >= 1, got 0"),
        ({"nprocs": 1.5}, "nprocs must be an int >= 1"),
        ({"nprocs": "2"}, "nprocs must be an int >= 1"),
        ({"nprocs": True}, "nprocs must be an int >= 1"),
        ({"launcher": "slurmish"}, "unknown launcher 'slurmish'"),
        ({"dist_url": "tcp://127.0.0.1"}, "dist_url='tcp://127.0.0.1' is not valid"),
        ({"dist_url": "http://h:1"}, "is not valid"),
        ({"dist_url": "tcp://h:99999"}, "is not valid"),
        ({"backend": "ncl"}, "unknown backend 'ncl'"),
        ({"timeout": -1}, "timeout must be a positive number"),
        ({"env": {"A=B": "1"}}, "env must be a dict"),
        ({"start_method": "thread"}, "start_method must be one of"),
    ],
)
def test_bad_options_fail_in_one_line_before_any_process(kwargs, message):
    before = _children()
    with pytest.raises(LaunchConfigError) as info:
        nbdist.launch(lambda: 1, **{"nprocs": 2, **kwargs})
    assert message in str(info.value) and "\n" not in str(info.value)
    assert _children() == before


def test_not_callable():
    with pytest.raises(LaunchConfigError, match="fn must be callable, got int"):
        nbdist.launch(3, nprocs=2)


def test_unpicklable_argument_is_named_with_its_type_and_leaves_no_run_dir(tmp_path):
    lock = threading.Lock()
    with pytest.raises(TypeError) as info:
        nbdist.launch(lambda x, y: 1, 1, y=lock, nprocs=2, run_dir=str(tmp_path))
    text = str(info.value)
    assert "argument 'y'" in text and "_thread.lock" in text and "\n" not in text
    assert not _children()
    assert os.listdir(tmp_path) == [], "a refused launch leaves no run dir"


def test_absurd_nprocs_is_refused_before_anything_exists(tmp_path, monkeypatch):
    monkeypatch.delenv("NBDIST_MAX_NPROCS", raising=False)
    before = _children()
    with pytest.raises(LaunchConfigError) as info:
        nbdist.launch(lambda: 1, nprocs=10000, run_dir=str(tmp_path))
    text = str(info.value)
    assert "nprocs=10000 is more ranks than this machine can sensibly run" in text and "\n" not in text
    assert "set NBDIST_MAX_NPROCS=10000" in text, "it says how to insist"
    assert _children() == before and os.listdir(tmp_path) == []
    # Insisting lifts the limit (checked without starting 10000 processes).
    monkeypatch.setenv("NBDIST_MAX_NPROCS", "10000")
    assert WorldOptions(nprocs=10000).check().nprocs == 10000
    # Engines that place ranks on other machines judge the count themselves.
    monkeypatch.delenv("NBDIST_MAX_NPROCS")
    assert WorldOptions(nprocs=10000, launcher="srun").check().nprocs == 10000


def test_env_dollar_mpi_without_mpi4py_is_one_clear_line(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        "import sys; sys.modules['mpi4py'] = None\n"
        "import nbdist\n"
        "try:\n    nbdist.launch(lambda: 1)\n"
        "except nbdist.LaunchConfigError as e:\n    print('ERR', e)\n"
    )
    env = dict(os.environ, PMI_SIZE="2", PMI_RANK="0")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60).stdout
    assert "ERR this kernel runs under MPI, and attaching needs mpi4py: pip install 'nbdist[mpi]'" in out, out


def test_fork_after_cuda_is_refused(monkeypatch):
    import torch

    # No GPU here: CUDA's own state is what we fake, the check itself is real.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LaunchConfigError, match="Cannot re-initialize CUDA in forked subprocess"):
        nbdist.launch(lambda: 1, nprocs=2, start_method="fork")
    assert not _children()


def test_the_fork_refusal_names_where_cuda_was_first_initialised(monkeypatch):
    """nbdist watches torch's lazy CUDA init and names the first caller (a notebook cell's line). No GPU
    here: CUDA's own init fails on this CPU build after the watch saw the call, and its state is faked."""
    import torch

    from nbdist.launchers import cuda_watch

    monkeypatch.setattr(cuda_watch, "_FIRST", {"where": None})
    monkeypatch.setattr(torch.cuda, "_lazy_init", torch.cuda._lazy_init)  # put back after the test
    assert cuda_watch.watch_cuda_init()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda._lazy_init()  # as ".cuda()" would call it (the CPU build can't go on)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LaunchConfigError) as info:
        nbdist.launch(lambda: 1, nprocs=2, start_method="fork")
    text = str(info.value)
    assert "(first by " in text and "test_inputs_and_tools.py, line" in text and "torch.cuda._lazy_init()" in text, text
    assert "\n" not in text


@pytest.mark.parametrize(
    "env, kind, size",
    [
        ({}, None, None),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, "torchrun", 4),
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, None, None),
        ({"PMI_SIZE": "4", "PMI_RANK": "2"}, "mpi", 4),
        ({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}, None, None),
        ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None, None),
        ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "3"}, "slurm", 4),
    ],
)
def test_detect_world_attaches_only_to_worlds_of_more_than_one(env, kind, size):
    world = detect_world(env)
    assert (world.kind if world else None) == kind
    assert (world.world_size if world else None) == size


def _orphan(run_id, **kw):
    env = dict(os.environ, NBDIST_RUN_ID=run_id)
    return subprocess.Popen(["sleep", "60"], env=env, start_new_session=True, **kw)


def test_ps_and_kill_find_leftovers_by_marker_never_by_name():
    orphan = _orphan("20990101-000000-abcdef")
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)  # same name, no marker
    try:
        wait_for(lambda: marked_pids("20990101-000000-abcdef"), 5, what="marked orphan")
        listed = nbdist.ps()
        assert [p.pid for p in listed if p.run_id == "20990101-000000-abcdef"] == [orphan.pid]
        assert bystander.pid not in {p.pid for p in listed}
        assert nbdist.kill("20990101-000000-abcdef") == 1
        assert orphan.wait(timeout=5) == -signal.SIGTERM
        assert bystander.poll() is None, "an unmarked process with the same name is never touched"
    finally:
        for p in (orphan, bystander):
            p.kill()
            p.wait()


def test_cli_ps_and_kill():
    orphan = _orphan("20990101-000000-c11c11")
    try:
        wait_for(lambda: marked_pids("20990101-000000-c11c11"), 5, what="marked orphan")
        cli = [sys.executable, "-m", "nbdist.frontend.cli"]
        out = subprocess.run([*cli, "ps"], capture_output=True, text=True, timeout=30).stdout
        assert "RUN ID" in out and "20990101-000000-c11c11" in out and str(orphan.pid) in out
        out = subprocess.run([*cli, "kill", "20990101-000000-c11c11"], capture_output=True, text=True, timeout=30).stdout
        assert "stopped 1 process" in out
        orphan.wait(timeout=5)
        out = subprocess.run([*cli, "ps"], capture_output=True, text=True, timeout=30).stdout
        assert "20990101-000000-c11c11" not in out
    finally:
        orphan.kill()
        orphan.wait()


def test_cli_help_says_what_each_command_lists_and_ends_and_errors_are_one_line():
    import rankfns

    cli = [sys.executable, "-m", "nbdist.frontend.cli"]

    def call(*words):
        return subprocess.run([*cli, *words], capture_output=True, text=True, timeout=30)

    kill_help = " ".join(call("kill", "--help").stdout.split())
    assert "a plain `nbdist kill` ends orphans only: processes whose kernel is gone" in kill_help
    assert "`%dist_kill` ends that kernel's own runs and the orphans" in kill_help
    assert "RUN_ID stop this run's processes" in kill_help and "--all also stop the runs and sessions of live" in kill_help
    ps_help = " ".join(call("ps", "--help").stdout.split())
    assert "whose it is (this process's, a live kernel's with its pid, or orphaned" in ps_help
    assert "RUN_ID list only this run's processes" in ps_help
    for words, rc, line in [(("kill", "20990101-000000-000000"), 1, "no live process carries run id"),
                            (("kill", "--all", "20990101-000000-000000"), 2, "give a RUN_ID or --all, not both")]:
        res = call(*words)
        assert res.returncode == rc and line in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    # From a shell a plain kill ends the orphan and leaves a live kernel's (this process's) run alone.
    run = nbdist.launch(rankfns.hang, nprocs=1, join=False, init_process_group=False)
    orphan = _orphan("20990101-000000-0c0c0c")
    try:
        wait_for(lambda: marked_pids(run.run_id) and marked_pids("20990101-000000-0c0c0c"), 60, what="both up")
        assert "stopped 1 process" in call("kill").stdout
        assert orphan.wait(timeout=5) == -signal.SIGTERM
        assert not run.done and marked_pids(run.run_id), "a live kernel's run stays"
    finally:
        run.kill()
        orphan.kill()
        orphan.wait()


def test_kill_stops_a_live_run_of_this_process():
    import rankfns

    run = nbdist.launch(rankfns.hang, nprocs=2, join=False, init_process_group=False)
    wait_for(lambda: len(marked_pids(run.run_id)) == 2, 60, what="ranks up")
    assert nbdist.kill(run.run_id) == 2
    assert run.status == "killed"


def test_core_imports_without_ipython_or_ipywidgets(tmp_path):
    script = tmp_path / "core_only.py"
    script.write_text(
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('IPython', 'ipywidgets', 'ipykernel'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import importlib, pkgutil, nbdist\n"
        "for m in pkgutil.walk_packages(nbdist.__path__, 'nbdist.'):\n"
        "    if not m.name.startswith('nbdist.frontend') and m.name != 'nbdist.worker.__main__':\n"
        "        importlib.import_module(m.name)  # everything but the front ends\n"
        "import nbdist.frontend.cli\n"
        "def fn():\n"
        "    return sorted(m for m in sys.modules if m.split('.')[0] in ('IPython', 'ipywidgets'))\n"
        "if __name__ == '__main__':\n"
        "    print('RESULT', nbdist.launch(fn, nprocs=2), fn())\n"
        "    with nbdist.Session(nprocs=2) as s:\n"
        "        print('SESSION', s.run(len, 'ab'), fn())\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert "RESULT {0: [], 1: []} []" in out.stdout, out.stdout + out.stderr
    assert "SESSION {0: 2, 1: 2} []" in out.stdout, out.stdout + out.stderr


def test_packaging_lists_agree():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    wanted = set(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted |= set(extra)
    with open(os.path.join(ROOT, "environment.yml")) as fh:
        text = fh.read()
    pip_block = text.split("- pip:", 1)[1]
    listed = {line.strip()[2:] for line in pip_block.splitlines() if line.strip().startswith("- ")}
    assert wanted == listed, f"only in pyproject: {wanted - listed}; only in environment.yml: {listed - wanted}"


def test_the_reformable_group_connects_nccl_for_cuda_and_aborts_it_on_release(monkeypatch):
    """The CUDA path of nbdist.reform, with NCCL faked (there is no GPU here): CUDA tensors go to an
    NCCL backend made with the group's timeout and bound as the default, CPU ones to gloo; a
    release aborts NCCL's communicators (which frees kernels waiting on a peer) before dropping
    them. One rank, a HashStore: the real gloo part connects for real."""
    import datetime

    import torch
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup, ProcessGroupGloo

    from nbdist.worker import reformable_groups as reform

    made = []

    class FakeNCCLOptions:
        _timeout = None

    def fake_nccl(store, rank, size, opts):  # a real backend object, so the group can register it
        made.append((rank, size, opts._timeout))
        gopts = ProcessGroupGloo._Options()
        gopts._timeout, gopts._devices = opts._timeout, [ProcessGroupGloo.create_default_device()]
        return ProcessGroupGloo(store, rank, size, gopts)

    fake_nccl.Options = FakeNCCLOptions
    monkeypatch.setattr(c10d, "ProcessGroupNCCL", fake_nccl, raising=False)
    timeout = datetime.timedelta(seconds=42)
    group = reform.ReformableGroup(dist.HashStore(), 0, 1, timeout, {"cpu": "gloo", "cuda": "nccl"}, name="g")
    assert made == [(0, 1, timeout)]
    inner = group._inner
    assert sorted(str(d) for d in inner._device_types) == ["cpu", "cuda"], inner._device_types
    t = torch.ones(3)
    group.allreduce([t]).wait()
    assert t.tolist() == [1.0, 1.0, 1.0] and group.issued == 1
    aborted = []
    monkeypatch.setattr(type(inner), "abort", lambda self: aborted.append(True), raising=False)
    group.release()
    assert aborted == [True] and group._inner is None
    with pytest.raises(RuntimeError, match="being re-formed"):
        group.allreduce([t])
    group.reform(1)
    assert len(made) == 2 and group.generation == 1 and group.issued == 0
    group.allreduce([t]).wait()
    assert isinstance(group, ProcessGroup) and group.getGroupName() == "g"
    # A rank stuck with no free peer cuts its own groups from a thread: NCCL is aborted there too
    # (one rank has no peers, so no socket of a pair to shut down; gloo's listener is never cut).
    aborted.clear()
    monkeypatch.setattr(type(group._inner), "abort", lambda self: aborted.append(True), raising=False)
    assert group.cut() == 0 and aborted == [True] and group._inner is None
