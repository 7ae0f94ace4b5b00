"""Warm start: ranks forked from a template that imported torch, with spawn's semantics.

The engine and magic suites run every test with warm ranks too (the ``start_method`` fixture and
the parametrized kernel); these are the template's own promises: CUDA safety, never stale,
the launch-time env, findable from another process, and a fallback to spawn that is said once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
import rankfns
from conftest import KEPT_TEMPLATES, marked_pids, wait_for

import nbdist
from nbdist.warmstart import handle as warmstart


@pytest.fixture
def own_template(monkeypatch):
    """A test that makes templates of its own: the session's is set aside, and what the test made is closed."""
    monkeypatch.delenv("NBDIST_START_METHOD", raising=False)
    saved = warmstart._CURRENT
    warmstart._CURRENT = None
    warmstart._TOLD.clear()
    yield
    for template in [*warmstart._RETIRING, *([warmstart._CURRENT] if warmstart._CURRENT else [])]:
        template.close()
    warmstart._RETIRING.clear()
    warmstart._CURRENT = saved


def report_place():
    import late_module  # importable only through the sys.path entry the kernel added after warm-up

    return {"env": os.environ.get("NBDIST_LATE"), "cwd": os.getcwd(), "module": late_module.VALUE,
            "ppid": os.getppid(), "leader": os.getpgid(0) == os.getpid()}


def test_env_sys_path_and_cwd_of_the_launch_reach_forked_ranks(warm_template, tmp_path, monkeypatch):
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "late_module.py").write_text("VALUE = 'from the late path'\n")
    monkeypatch.setenv("NBDIST_LATE", "set after warm-up")
    monkeypatch.syspath_prepend(str(extra))
    monkeypatch.chdir(tmp_path)
    run = nbdist.launch(report_place, nprocs=2, start_method="warm", init_process_group=False, join=False)
    out = run.wait(timeout=60)
    assert run.launcher.start_method == "warm"
    for value in out.values():
        assert value == {"env": "set after warm-up", "cwd": str(tmp_path), "module": "from the late path",
                         "ppid": warm_template.pid, "leader": True}


def test_preload_that_initialises_cuda_is_refused_in_one_line_and_launches_spawn(own_template, tmp_path,
                                                                                  monkeypatch, capfd):
    # No GPU here: the module makes CUDA *look* initialised, which is what the template checks.
    (tmp_path / "grabs_cuda.py").write_text("import torch\ntorch.cuda._initialized = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    template = nbdist.warm(preload=["grabs_cuda"], wait=True, timeout=90)
    KEPT_TEMPLATES.add(template.pid)  # it stays listed, refusing, until the test closes it
    try:
        assert template.status == "refused" and "'grabs_cuda' initialised CUDA" in template.reason
        for _ in range(2):
            run = nbdist.launch(rankfns.rank_sum, nprocs=2, join=False)
            assert run.wait(timeout=90) == {0: 3.0, 1: 3.0}
            assert run.launcher.start_method == "spawn"
        assert nbdist.launch(rankfns.rank_sum, nprocs=2, start_method="warm") == {0: 3.0, 1: 3.0}
        err = capfd.readouterr().err
        lines = [line for line in err.splitlines() if "grabs_cuda" in line]
        assert len(lines) == 1, err
        assert lines[0].startswith("nbdist: preload module 'grabs_cuda' initialised CUDA") and "spawn" in lines[0]
    finally:
        KEPT_TEMPLATES.discard(template.pid)


def test_staleness_is_checked_by_file_for_the_user_s_code_and_by_folder_for_installed_code(tmp_path, monkeypatch):
    """Installed code is watched by its folders (an installer adds, replaces or removes files), the
    user's own files one by one (saving one changes it): a fork request costs a stat per folder of
    torch, not per file."""
    from nbdist.warmstart import template

    site, mine = tmp_path / "site", tmp_path / "mine"
    (site / "libpkg").mkdir(parents=True)
    mine.mkdir()
    (site / "libpkg" / "__init__.py").write_text("")
    (site / "libpkg" / "core.py").write_text("A = 1\n")
    (mine / "usermod.py").write_text("B = 1\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(mine))
    installed_roots = template._installed_roots
    monkeypatch.setattr(template, "_installed_roots", lambda: (os.path.join(str(site), ""),))
    for name in ("libpkg", "libpkg.core", "usermod"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import libpkg.core  # noqa: F401
    import usermod  # noqa: F401

    def later(path):
        os.utime(path, (time.time() + 5,) * 2)

    files = template._module_files()
    assert str(site / "libpkg") in files and str(site / "libpkg" / "core.py") not in files
    assert str(mine / "usermod.py") in files and template.find_refusal(files) is None
    later(mine / "usermod.py")
    assert "module 'usermod' changed on disk" in template.find_refusal(files)
    files = template._module_files()
    (site / "libpkg" / "core.py").rename(site / "libpkg" / "core.py.old")  # an installer replacing it
    (site / "libpkg" / "core.py").write_text("A = 2\n")
    assert "module 'libpkg' changed on disk" in template.find_refusal(files) and str(site / "libpkg") in \
        template.find_refusal(files)
    monkeypatch.setattr(template, "_installed_roots", installed_roots)  # this process's real site-packages
    assert len(template._module_files()) < len(sys.modules) / 2, "installed modules share their folders' stats"


def test_a_module_changed_on_disk_is_not_served_stale(own_template, tmp_path, monkeypatch, capfd):
    module = tmp_path / "preloaded_mod.py"
    module.write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    template = nbdist.warm(preload=["preloaded_mod"], wait=True, timeout=90)
    assert template.status == "ready"

    def value():
        import preloaded_mod

        return preloaded_mod.VALUE

    run = nbdist.launch(value, nprocs=2, init_process_group=False, join=False)
    assert run.wait(timeout=60) == {0: 1, 1: 1} and run.launcher.start_method == "warm"
    module.write_text("VALUE = 2\n")
    later = time.time() + 5
    os.utime(module, (later, later))
    run = nbdist.launch(value, nprocs=2, init_process_group=False, join=False)
    assert run.wait(timeout=90) == {0: 2, 1: 2} and run.launcher.start_method == "spawn"
    err = capfd.readouterr().err
    assert "module 'preloaded_mod' changed on disk" in err and "a fresh template is starting; starting the ranks with spawn" in err, err
    fresh = warmstart.current_template()
    assert fresh is not template and fresh.wait_ready(90)
    run = nbdist.launch(value, nprocs=2, init_process_group=False, join=False)
    assert run.wait(timeout=60) == {0: 2, 1: 2} and run.launcher.start_method == "warm"


def test_ps_from_another_process_finds_forked_ranks_and_their_workers(warm_template, tmp_path):
    run = nbdist.launch(rankfns.sleep_with_loader, str(tmp_path), nprocs=2, start_method="warm", join=False,
                        init_process_group=False)
    wait_for(lambda: len([f for f in os.listdir(tmp_path) if f.startswith("ready.")]) == 2, 60, what="ranks ready")
    script = ("import json, nbdist; print(json.dumps([[p.run_id, p.rank, p.pid, p.run_dir] for p in nbdist.ps()]))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    found = json.loads(out.stdout)
    mine = [f for f in found if f[0] == run.run_id]
    assert {f[1] for f in mine if f[1] is not None} == {0, 1}
    assert {f[2] for f in mine if f[1] is not None} == set(run.pids.values())
    assert len(mine) >= 6, "2 ranks and 4 DataLoader workers carry the run's marker"
    assert all(f[3] == run.run_dir for f in mine)
    assert [f for f in found if f[2] == warm_template.pid and f[0].startswith("warm-")], "the template is listed"
    run.interrupt()
    assert not marked_pids(run.run_id)


def test_a_killed_template_means_spawn_until_a_new_one_is_ready(own_template, capfd):
    template = nbdist.warm(wait=True, timeout=90)
    assert nbdist.kill(template.run_id) == 1
    wait_for(lambda: not psutil.pid_exists(template.pid) or template.proc.poll() is not None, 5, what="template gone")
    run = nbdist.launch(rankfns.rank_sum, nprocs=2, join=False)
    assert run.wait(timeout=90) == {0: 3.0, 1: 3.0} and run.launcher.start_method == "spawn"
    assert "exited" in capfd.readouterr().err
    fresh = warmstart.current_template()
    assert fresh is not template and fresh.wait_ready(90)
    run = nbdist.launch(rankfns.rank_sum, nprocs=2, join=False)
    assert run.wait(timeout=60) == {0: 3.0, 1: 3.0} and run.launcher.start_method == "warm"


def test_nbdist_warm_0_starts_no_template_at_load(own_template, monkeypatch):
    monkeypatch.setenv("NBDIST_WARM", "0")
    assert warmstart.start_in_background() is None and warmstart.current_template() is None
    assert nbdist.launch(rankfns.rank_sum, nprocs=2) == {0: 3.0, 1: 3.0}


def train_and_keep_the_model():
    """DDP trains, and the model stays in the rank's namespace, bound to its groups, as a cell's would."""
    import __main__

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
    __main__.model, __main__.pair = model, dist.new_group([0, 1])
    return round(float(sum(p.sum() for p in model.parameters())), 4)


@pytest.mark.parametrize("how", ["warm", "spawn"])
def test_ranks_leave_fast_and_cleanly_with_ddp_models_bound_to_their_groups(warm_template, how):
    """A rank leaves by os._exit with its groups shut down but never destructed (gloo's destructor
    joins its threads: 20-40 ms of a fresh 4-rank cell); the user's DDP model and subgroup are
    released on the way out, which once aborted a rank with its group live (SIGABRT)."""
    for _ in range(3 if how == "warm" else 1):
        run = nbdist.launch(train_and_keep_the_model, nprocs=4, start_method=how, join=False)
        out = run.wait(timeout=120)
        assert len(set(out.values())) == 1, out  # the ranks trained in step
        assert {st.exitcode for st in run.ranks.values()} == {0}, run.ranks
