"""Guarantees one step beside the happy path: a restart after a death, values the kernel can't load, a stop
during large rich output, finalisation that can't hang, pids of other hosts, runs roots others could
write, the order of things at exit, SIGINT inherited as ignored, and how long run dirs stay."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import rankfns
from conftest import began, marked_pids, wait_began, wait_for

import nbdist
from nbdist.errors import LaunchConfigError, RankGoneError, RunStoppedError, WorkerFailedError
from nbdist.launchers.engine import EngineLauncher
from nbdist.options import WorldOptions
from nbdist.protocol.registration import record_pid
from nbdist.protocol.rundir import write_private
from nbdist.run import retention
from nbdist.run.start import start_run

ALL_REDUCE = "t = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\nt.item()"


@pytest.fixture
def session(start_method):
    s = nbdist.Session(nprocs=2)
    try:
        assert s.wait_ready(120)
        s.execute("import torch, torch.distributed as dist")
        yield s
    finally:
        s.close()


# ---- a restart is a new incarnation ------------------------------------------------------------
def test_a_session_restarted_after_a_death_in_a_cell_takes_cells_for_30_s(session):
    """A rank dies while its peer waits in a barrier; the restart comes within the second. Nothing of
    the dead incarnation (the peer's failure releasing, a late stop, its timers) touches the new ranks."""
    old = session.session_id
    with pytest.raises(WorkerFailedError) as info:  # the survivor keeps its state: degraded, not lost
        session.execute("import os, time\nif dist.get_rank() == 1:\n    time.sleep(0.3)\n    os.kill(os.getpid(), 9)\n"
                        "dist.barrier()", timeout=20)
    text = str(info.value)
    assert text.count("failed first") == 1 and "rank 1 failed first: killed by SIGKILL" in text, text
    assert "rank 0 failed first" not in text and text.count("restart()") == 1, text
    with pytest.raises(RankGoneError, match="rank 1 was killed by SIGKILL.*restart"):
        session.run(lambda: 1)
    session.restart()
    assert session.wait_ready(120) and session.session_id != old
    wait_for(lambda: not marked_pids(old), 5, what="the old incarnation's tree to go")
    session.execute("import torch, torch.distributed as dist\nkept = 0")
    rng, cells, end = random.Random(15), 0, time.monotonic() + 30
    while time.monotonic() < end:
        assert session.execute(ALL_REDUCE + "\nkept += 1\n(t.item(), kept)", timeout=30) == \
            {0: (3.0, cells + 1), 1: (3.0, cells + 1)}
        cells += 1
        time.sleep(rng.uniform(0, 0.8))  # idle gaps: a stale timer or recovery step would act in one
    assert session.status == "idle" and cells > 10, cells  # about 40 on a quiet box


def test_a_timed_out_cell_s_timer_never_reaches_the_next_incarnation(session, tmp_path):
    # 6 s: the cell's ranks must begin and the restart start before the timer fires, on a busy box too.
    cell = session.execute(began("import time\ntime.sleep(60)", tmp_path / "c"), timeout=6.0, join=False)
    wait_began(tmp_path / "c", 2)
    assert not cell.done, "the timer fired before the restart: the premise is gone"
    session.restart()  # before the timer fires
    assert session.wait_ready(120)
    assert cell.done and cell.status == "lost"
    busy = session.execute("import time\ntime.sleep(7.5)\n'done'", join=False)  # spans the old timer's moment
    assert busy.wait(30) == {0: "done", 1: "done"}


# ---- what crosses back to the kernel ------------------------------------------------------------
def test_a_value_the_kernel_cannot_load_is_that_cells_error_and_the_session_goes_on(session, tmp_path):
    (tmp_path / "only_on_ranks.py").write_text("class Thing:\n    pass\n")
    session.execute(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport only_on_ranks\nthing = only_on_ranks.Thing()")
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        session.execute("thing")
    assert "could not load the value that rank" in str(info.value) and "only_on_ranks" in str(info.value)
    assert time.monotonic() - t0 < 10 and session.status == "idle"
    assert session.execute(ALL_REDUCE) == {0: 3.0, 1: 3.0}
    assert session.execute("type(thing).__name__") == {0: "Thing", 1: "Thing"}


def test_a_run_whose_value_the_kernel_cannot_load_says_so_and_ends(tmp_path):
    (tmp_path / "only_on_ranks.py").write_text("class Thing:\n    pass\n")
    run = nbdist.launch(rankfns.value_only_ranks_can_load, str(tmp_path), nprocs=2, join=False,
                        init_process_group=False)
    with pytest.raises(WorkerFailedError, match="returned a value the kernel could not load"):
        run.wait(60)
    assert run.done and not marked_pids(run.run_id)


def test_a_stop_during_large_rich_output_never_tears_the_channel(session):
    """Each display is 40 KB, sent as a header and a body; the stop lands between them, often."""
    for delay in (0.2, 0.35, 0.5, 0.65, 0.8):
        cell = session.execute("from IPython.display import display\nimport itertools\n"
                               "bundle = {'text/plain': 'x' * 40_000}\nfor i in itertools.count():\n"
                               "    display(bundle, raw=True)", join=False)
        wait_for(lambda: len(cell.displays) > 4, 30, what="displays to arrive")
        time.sleep(delay)
        cell.interrupt()
        with pytest.raises(RunStoppedError, match="idle again, their state kept"):
            cell.wait(30)
        assert session.status == "idle"
        assert session.execute(ALL_REDUCE) == {0: 3.0, 1: 3.0}, "the channel is whole"


# ---- ending never hangs ----------------------------------------------------------------------
def test_a_stop_whose_teardown_raises_still_ends_the_run(monkeypatch):
    from nbdist.run import teardown

    real, calls = teardown.stop_tree, []

    def flaky(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise PermissionError(1, "Operation not permitted")
        return real(*args, **kwargs)

    monkeypatch.setattr(teardown, "stop_tree", flaky)
    run = nbdist.launch(rankfns.hang, nprocs=2, join=False, init_process_group=False)
    wait_for(lambda: len(marked_pids(run.run_id)) == 2, 60, what="ranks up")
    run.interrupt()
    assert run.done and run.status == "interrupted", run.status
    with pytest.raises(RunStoppedError):
        run.wait(5)
    wait_for(lambda: not marked_pids(run.run_id), 5, what="the ranks to go all the same")


# ---- pids of other machines -------------------------------------------------------------------
@dataclass
class _FakeEngine(EngineLauncher):
    """An 'engine' that starts nothing but itself; the test registers its ranks by hand."""

    name: str = "fake-engine"

    def command(self, run_dir, nprocs):
        return [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_rank_on_another_host_is_never_signalled():
    """A rank registered from another machine whose pid is, here, an unrelated process: the timeout's
    stack dump, the teardown and the exit checks never touch that pid."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    launcher = _FakeEngine()
    run = start_run(rankfns.hang, (), {}, WorldOptions(nprocs=2, init_process_group=False, timeout=2.0).check(),
                    launcher=launcher)
    local = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                             env=dict(os.environ, NBDIST_RUN_ID=run.run_id, NBDIST_RUN_DIR=run.run_dir))
    try:
        record_pid(run.run_dir, 0, local.pid)
        os.makedirs(os.path.join(run.run_dir, "ranks"), exist_ok=True)  # rank 1 registers from another host
        write_private(os.path.join(run.run_dir, "ranks", "1.pid"), f"{bystander.pid} gpu-node-7\n".encode())
        wait_for(lambda: launcher.remote_slots() == {1}, 5, what="the ranks to register")
        assert bystander.pid not in launcher.leaders() and local.pid in launcher.leaders()
        assert run.local_pids() == {0: local.pid}
        with pytest.raises(nbdist.RunTimeoutError):
            run.wait(30)
        assert local.wait(5) is not None, "the local rank was stopped"
        assert bystander.poll() is None, "the other machine's pid, here an unrelated process, was never signalled"
    finally:
        for p in (local, bystander):
            p.kill()
            p.wait()


# ---- the runs root ------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["symlink", "group-writable", "world-writable"])
def test_a_runs_root_others_could_write_is_refused_in_one_line(tmp_path, how):
    root = tmp_path / "runs"
    if how == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "real")
    else:
        root.mkdir()
        os.chmod(root, 0o770 if how == "group-writable" else 0o777)
    for start in (lambda: nbdist.launch(rankfns.rank_sum, nprocs=2, run_dir=str(root)),
                  lambda: nbdist.Session(nprocs=2, run_dir=str(root))):
        with pytest.raises(LaunchConfigError) as info:
            start()
        text = str(info.value)
        assert "\n" not in text and str(root) in text, text
        assert ("symlink" in text) if how == "symlink" else ("chmod go-w" in text and "writable by" in text), text
    assert os.listdir(root) == [], "a refused start leaves nothing behind"


# ---- the order at exit ------------------------------------------------------------------------
def test_a_kernel_that_exits_closes_its_warm_session_gracefully(run_script, tmp_path):
    """Sessions close before the template goes: a warm session rank runs its own atexit handlers."""
    flag = tmp_path / "atexit-ran"
    proc = run_script(
        f"""
        import nbdist
        nbdist.warm(wait=True)
        s = nbdist.Session(nprocs=2, start_method="warm")
        s.wait_ready(120)
        s.execute("import atexit, os\\n"
                  "atexit.register(lambda: open({str(flag)!r} + os.environ['RANK'], 'w').close())")
        print("SESSION", s.session_id, flush=True)
        """
    )
    out, _ = proc.communicate(timeout=120)
    sid = out.split("SESSION ")[1].split()[0]
    assert proc.returncode == 0, out
    wait_for(lambda: not marked_pids(sid), 5, what="the session to go with its kernel")
    assert sorted(p.name for p in tmp_path.glob("atexit-ran*")) == ["atexit-ran0", "atexit-ran1"], out


def test_warm_start_off_leaves_live_warm_ranks_alone(run_script):
    """``%dist_warm --off`` retires the template: a live warm session goes on, launches spawn, and the
    template leaves once its ranks have. (A kernel of its own: the suite's template stays as it is.)"""
    proc = run_script(
        """
        import nbdist
        from nbdist.warmstart import handle
        nbdist.warm(wait=True)
        with nbdist.Session(nprocs=2, start_method="warm") as s:
            s.wait_ready(120)
            s.execute("import torch, torch.distributed as dist\\nkept = 7")
            retired = handle.retire_templates()
            print("RETIRED", retired.status, flush=True)
            print("KEPT", s.execute("kept"), flush=True)
            print("SUM", s.execute("t = torch.ones(1)\\ndist.all_reduce(t)\\nt.item()"), flush=True)
            print("NEXT", handle.choose_start_method(None), flush=True)
        retired.proc.wait(10)
        print("TEMPLATE LEFT", retired.proc.returncode, flush=True)
        """
    )
    out, _ = proc.communicate(timeout=180)
    assert "RETIRED retired" in out and "KEPT {0: 7, 1: 7}" in out and "SUM {0: 2.0, 1: 2.0}" in out, out
    assert "NEXT spawn" in out and "TEMPLATE LEFT 0" in out, out


# ---- SIGINT inherited as ignored ---------------------------------------------------------------
def test_ranks_of_a_kernel_that_ignores_sigint_still_take_the_stop_as_keyboardinterrupt(run_script):
    """nohup, a background job of a script, some CI agents: the kernel starts with SIGINT ignored and
    its children inherit that. A rank sets its own: the stop is a KeyboardInterrupt, not a SIGTERM."""
    proc = run_script(
        f"""
        import sys, time, nbdist
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import rankfns
        from nbdist.protocol.registration import read_running
        run = nbdist.launch(rankfns.spin, nprocs=2, join=False, init_process_group=False, start_method="spawn")
        while len(read_running(run.run_dir)) < 2:  # both ranks in the user's code
            time.sleep(0.05)
        time.sleep(0.5)
        report = run.interrupt()
        print("STOPPED", report.last_signal, run.status, flush=True)
        """,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    out, _ = proc.communicate(timeout=120)
    assert "STOPPED SIGINT interrupted" in out, out


# ---- how long run dirs stay ---------------------------------------------------------------------
def test_a_run_leaves_its_logs_and_not_its_data(tmp_path):
    big = bytes(8 << 20)
    run = nbdist.launch(rankfns.takes_anything, big, nprocs=2, join=False, init_process_group=False,
                        run_dir=str(tmp_path))
    assert run.wait(60) == {0: 1, 1: 1}
    files = sorted(os.listdir(run.run_dir))
    assert "payload.pkl" not in files and not [f for f in files if f.startswith("result.")], files
    assert "rank0.stderr" in files and "spec.json" in files and "ended.json" in files, files
    size = sum(os.path.getsize(os.path.join(run.run_dir, f)) for f in files)
    assert size < 64 << 10, f"{size} bytes left: the pushed 8 MB went with the run"
    retention.prune_runs(str(tmp_path))  # a recent run: kept, and its size added to the record it left
    record = json.loads((tmp_path / run.run_id / "ended.json").read_text())
    assert record["status"] == "finished" and 0 < record["size"] <= size, (record, size)


def test_pruning_keeps_live_recent_and_failed_runs_and_drops_the_rest(tmp_path):
    root = tmp_path / "runs"
    root.mkdir(mode=0o700)
    dead = subprocess.Popen(["true"])
    dead.wait()
    now = time.time()

    def make(name, status, age_days, size=1000, owner=None):
        d = root / name
        d.mkdir(mode=0o700)
        created = now if owner else now - age_days * 86400  # a live kernel is older than its run dirs
        (d / "spec.json").write_text(f'{{"run_id": "{name}", "nprocs": 1, "world_size": 1, '
                                     f'"parent_pid": {owner or dead.pid}, "created": {created}}}')
        (d / "rank0.stderr").write_bytes(b"x" * size)
        if status:
            (d / "ended.json").write_text(f'{{"status": "{status}", "time": {now - age_days * 86400}}}')
        for f in d.iterdir():
            os.utime(f, (now - age_days * 86400,) * 2)
        os.utime(d, (now - age_days * 86400,) * 2)

    make("old-finished", "finished", 10)
    make("old-failed", "failed", 10)
    make("recent-finished", "finished", 1, size=3 << 20)
    make("recent-failed", "failed", 0.5, size=3 << 20)
    make("newest-finished", "finished", 0.1, size=1000)
    make("lost-kernel", None, 9)  # its kernel died without ending it
    make("live", None, 30, owner=os.getpid())  # this kernel's, not ended: never pruned
    report = retention.prune_runs(str(root), setting=retention.Retention(keep_days=7, max_mb=4))
    left = sorted(p.name for p in root.iterdir())
    # Past 7 days: gone. Past 4 MB: the oldest finished run goes first, failed ones after.
    assert left == ["live", "newest-finished", "recent-failed"], (left, report)
    assert "run dirs (logs) are in" in retention.describe_retention(str(root))


def test_pruning_reads_an_ended_run_s_record_and_walks_no_ended_dir(tmp_path, monkeypatch):
    """A kernel prunes on a thread that shares the notebook's GIL: an ended run's size and time come
    from the one small record it left at its end, however many files (a session's cells) it holds."""
    root = tmp_path / "runs"
    root.mkdir(mode=0o700)
    now = time.time()
    for name, age_days, size in (("old", 10, 10), ("big", 0.5, 5 << 20), ("small", 0.1, 1000)):
        d = root / name
        d.mkdir(mode=0o700)
        (d / "rank0.stderr").write_bytes(b"x")  # fresh and tiny: only the record says old, or big
        (d / "ended.json").write_text(json.dumps({"status": "finished", "time": now - age_days * 86400, "size": size}))
    walked = []
    monkeypatch.setattr(retention, "_measure", lambda path: walked.append(path) or (0, now))
    report = retention.prune_runs(str(root), setting=retention.Retention(keep_days=7, max_mb=4))
    assert sorted(p.name for p in root.iterdir()) == ["small"] and not walked, (report, walked)


def test_cli_ps_says_where_logs_are_and_how_long_they_stay():
    out = subprocess.run([sys.executable, "-m", "nbdist.frontend.cli", "ps"], capture_output=True, text=True,
                         timeout=60).stdout
    assert "kept 7 days after its run ended" in out and "NBDIST_RUNS_KEEP_DAYS" in out, out


def test_kill_leaves_another_live_kernels_run_alone_and_takes_orphans(run_script, warm_template):
    """Another process's live run is listed as its own and only stopped by run id or all=True;
    a marked process whose kernel is gone is an orphan, which the default scope ends."""
    proc = run_script(
        f"""
        import sys, time, nbdist
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import rankfns
        run = nbdist.launch(rankfns.hang, nprocs=2, join=False, init_process_group=False)
        print("RUN", run.run_id, flush=True)
        time.sleep(600)
        """
    )
    theirs = proc.stdout.readline().split()[1]
    from nbdist.warmstart.handle import current_template

    warm_alive = lambda: current_template().proc.poll() is None  # noqa: E731
    orphan = subprocess.Popen(["sleep", "60"], start_new_session=True,
                              env=dict(os.environ, NBDIST_RUN_ID="20990101-000000-0a0a0a"))
    try:
        wait_for(lambda: len(marked_pids(theirs)) == 2 and marked_pids("20990101-000000-0a0a0a"), 60,
                 what="the other kernel's ranks and the orphan")
        listed = {p.pid: p for p in nbdist.ps()}
        assert {listed[p].whose() for p in marked_pids(theirs)} == {f"kernel pid {proc.pid}"}
        assert listed[orphan.pid].orphaned
        assert nbdist.kill() == 1, "the orphan only"
        assert orphan.wait(5) is not None and len(marked_pids(theirs)) == 2
        assert nbdist.kill(all=True) == 2, "all: every kernel's runs (a live kernel's template is not a run)"
        wait_for(lambda: not marked_pids(theirs), 5, what="--all to take the other kernel's run")
        assert warm_alive(), "this kernel's own template is not a leftover"
    finally:
        orphan.kill()
        proc.kill()
        proc.wait()
