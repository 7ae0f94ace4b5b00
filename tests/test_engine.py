"""The engine's guarantees, on real spawned ranks with gloo."""

from __future__ import annotations

import os
import signal
import stat
import threading
import time

import psutil
import pytest
import rankfns
from conftest import marked_pids, start_parent_with_loader_ranks, wait_for

import nbdist
from nbdist.protocol.registration import read_rank_pids
from nbdist.protocol.signals import STACK_DUMP_SIGNAL
from nbdist.errors import format_rank_set

# Every test twice: ranks spawned, and ranks forked from the warm template (NBDIST_START_METHOD).
pytestmark = pytest.mark.usefixtures("start_method")


def test_launch_returns_every_ranks_value():
    assert nbdist.launch(rankfns.rank_sum, nprocs=3) == {0: 6.0, 1: 6.0, 2: 6.0}


def test_ranks_see_torchrun_env_marker_and_own_group():
    out = nbdist.launch(rankfns.report_env, nprocs=2)
    run_ids = {v["env"]["NBDIST_RUN_ID"] for v in out.values()}
    assert len(run_ids) == 1 and None not in run_ids
    for rank, v in out.items():
        env = v["env"]
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert v["initialized"] and v["backend"] == "gloo"
        assert v["marker_in_exec_env"], "the marker must be in /proc/PID/environ, where ps finds it"
        assert v["group_leader"], "each rank leads its own process group"


def test_starting_ranks_never_changes_the_kernels_environ():
    # A subprocess the notebook starts while ranks start must not carry the run marker (%dist_stop
    # would kill it) or the run's --env values: a thread samples os.environ all along.
    watched = [k for k in ("NBDIST_RUN_ID", "NBDIST_RUN_DIR", "NBDIST_TEST_FLAG", "OMP_NUM_THREADS")
               if k not in os.environ]
    assert "NBDIST_RUN_ID" in watched and "NBDIST_TEST_FLAG" in watched
    seen, samples, done = set(), [0], threading.Event()

    def sample():
        while not done.is_set():
            seen.update(k for k in watched if k in os.environ)
            samples[0] += 1

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = nbdist.launch(rankfns.report_env_with, ("NBDIST_TEST_FLAG",), nprocs=2, env={"NBDIST_TEST_FLAG": "on"})
    finally:
        done.set()
        sampler.join(10)
    print(f"{samples[0]} samples of the kernel's environ while 2 ranks started")
    assert samples[0] > 100 and not seen, f"the kernel's os.environ held {sorted(seen)} while ranks started"
    for v in out.values():
        assert v["env"]["NBDIST_TEST_FLAG"] == "on" and v["marker_in_exec_env"], v


def test_lambdas_closures_and_kwargs_travel_by_value():
    scale = 10

    def closure(x, *, y):
        return (nbdist.rank() + x) * scale + y

    assert nbdist.launch(closure, 1, y=5, nprocs=2, init_process_group=False) == {0: 15, 1: 25}
    assert nbdist.launch(lambda: nbdist.world_size(), nprocs=2) == {0: 2, 1: 2}


def test_a_rank_that_returns_runs_its_atexit_handlers_and_exits_cleanly(start_method, tmp_path):
    """A rank leaves without torch's C++ teardown (see worker._leave_rank), but what users rely on
    at exit still runs: atexit handlers (loggers, trackers), files flushed."""

    def register(path):
        import atexit
        import sys

        handle = open(os.path.join(path, f"log.{nbdist.rank()}"), "w")
        handle.write("unflushed")
        sys.modules["__main__"].__dict__["kept_open"] = handle  # open until the rank's namespace goes
        atexit.register(lambda: open(os.path.join(path, f"exit.{nbdist.rank()}"), "w").close())
        return nbdist.rank()

    run = nbdist.launch(register, str(tmp_path), nprocs=2, join=False)
    assert run.wait(60) == {0: 0, 1: 1} and all(st.exitcode == 0 for st in run.ranks.values())
    assert sorted(p.name for p in tmp_path.glob("exit.*")) == ["exit.0", "exit.1"]
    assert all(p.read_text() == "unflushed" for p in tmp_path.glob("log.*"))


def test_functions_and_classes_from_main_work(run_script):
    proc = run_script(
        """
        import nbdist

        class Acc:
            def __init__(self, k):
                self.k = k
            def value(self):
                return self.k * (nbdist.rank() + 1)

        def work(k):
            return Acc(k).value(), type(Acc(k)).__name__

        if __name__ == "__main__":
            print("RESULT", nbdist.launch(work, 3, nprocs=2))
        """
    )
    out, _ = proc.communicate(timeout=90)
    assert "RESULT {0: (3, 'Acc'), 1: (6, 'Acc')}" in out, out


def test_join_false_returns_a_run():
    run = nbdist.launch(rankfns.rank_sum, nprocs=2, join=False)
    assert isinstance(run, nbdist.Run)
    assert run.status in ("starting", "running")
    assert set(run.pids) == {0, 1} and all(p > 0 for p in run.pids.values())
    assert run.wait(timeout=90) == {0: 3.0, 1: 3.0}
    assert run.status == "finished" and run.results == {0: 3.0, 1: 3.0}
    assert os.path.isdir(run.run_dir) and run.run_id in run.run_dir


def _start_loader_run(tmp_path, nprocs):
    run = nbdist.launch(rankfns.sleep_with_loader, str(tmp_path), nprocs=nprocs, join=False, init_process_group=False)
    wait_for(lambda: len([f for f in os.listdir(tmp_path) if f.startswith("ready.")]) == nprocs, 90,
             what="DataLoader workers in every rank")
    return run


def test_interrupt_stops_ranks_and_dataloader_grandchildren(tmp_path):
    run = _start_loader_run(tmp_path, 4)
    tree = {p.pid for pid in run.pids.values() for p in psutil.Process(pid).children(recursive=True)}
    assert len(tree) >= 8, "4 ranks x 2 DataLoader workers"
    t0 = time.monotonic()
    report = run.interrupt()
    elapsed = time.monotonic() - t0
    assert run.status == "interrupted"
    assert report.ranks == 4 and report.children >= 8 and not report.survivors
    assert elapsed <= 7.0, elapsed  # the ladder's one 5 s deadline, then the look that the tree is gone
    assert not [p for p in tree | set(run.pids.values()) if psutil.pid_exists(p) and
                psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    with pytest.raises(nbdist.RunStoppedError, match="interrupted"):
        run.wait()


def test_sigint_to_a_real_parent_interrupts_the_run(run_script, tmp_path):
    proc = run_script(
        f"""
        import sys, nbdist
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import rankfns
        if __name__ == "__main__":
            try:
                nbdist.launch(rankfns.sleep_with_loader, {str(tmp_path)!r}, nprocs=2, init_process_group=False)
            except KeyboardInterrupt:
                left = [p for p in nbdist.ps() if not p.run_id.startswith("warm-")]  # warm templates stay
                print("KEYBOARDINTERRUPT left:", len(left))
        """
    )
    wait_for(lambda: len([f for f in os.listdir(tmp_path) if f.startswith("ready.")]) == 2, 90, what="ranks ready")
    assert marked_pids()
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert "KEYBOARDINTERRUPT left: 0" in out, out
    assert not marked_pids()


def test_parent_sigkill_takes_ranks_and_grandchildren_down(run_script, tmp_path):
    proc, run_id = start_parent_with_loader_ranks(run_script, tmp_path)
    owned = marked_pids(run_id)
    assert len(owned) >= 6, "2 ranks and 4 DataLoader workers carry the marker"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    wait_for(lambda: not marked_pids(run_id), 3.0, what="ranks and grandchildren to die with their parent")
    print(f"parent death -> nothing left in {time.monotonic() - t0:.2f} s")


@pytest.mark.parametrize(
    "how, signal_name, exitcode",
    [("raise", None, 1), ("exit", None, 3), ("signal", "SIGKILL", -9), ("segv", "SIGSEGV", -11)],
)
def test_fail_fast_names_the_rank_that_failed(how, signal_name, exitcode):
    run = nbdist.launch(rankfns.fail_on, 2, how, nprocs=4, join=False)
    with pytest.raises(nbdist.WorkerFailedError) as info:
        run.wait(timeout=60)
    failed_at = run.ranks[2].ended
    assert run.ended - failed_at < 4.0, "the others are torn down at once, not after a collective's timeout"
    err = info.value
    assert err.rank == 2, str(err)
    root = err.failures[2]
    assert root.exitcode == exitcode and root.signal_name == signal_name
    assert root.pid == run.pids[2]
    assert "rank 2 failed first" in str(err)
    if how == "raise":
        assert "ValueError: boom on rank 2" in str(err) and "rankfns.py" in root.traceback
    if signal_name:
        assert signal_name in str(err)
    assert run.status == "failed"


def test_identical_tracebacks_are_shown_once():
    with pytest.raises(nbdist.WorkerFailedError) as info:
        nbdist.launch(rankfns.same_error_on_ranks_1_up, nprocs=4)
    text = str(info.value)
    # Ranks 1-3 raise within milliseconds; on a busy box fail-fast may stop one before it raised.
    raised = sorted(r for r, f in info.value.failures.items() if f.exc_type == "KeyError")
    assert info.value.rank in (1, 2, 3) and len(raised) >= 2 and set(raised) <= {1, 2, 3}, info.value.failures
    assert f"--- traceback from {format_rank_set(raised)} ---" in text, text
    assert text.count("KeyError: 'missing'\n") == 1, text


def test_results_of_finished_ranks_are_kept_on_failure():
    with pytest.raises(nbdist.WorkerFailedError) as info:
        nbdist.launch(rankfns.quick_then_fail, nprocs=2, init_process_group=False)
    assert info.value.rank == 1
    assert info.value.results == {0: 42}


def test_timeout_dumps_every_stack_then_stops():
    run = nbdist.launch(rankfns.hang, nprocs=2, timeout=4, join=False, init_process_group=False)
    with pytest.raises(nbdist.RunTimeoutError, match="timed out after 4 s") as info:
        run.wait(timeout=60)
    assert isinstance(info.value, TimeoutError)
    for rank in (0, 1):
        with open(os.path.join(run.run_dir, f"rank{rank}.stderr")) as fh:
            log = fh.read()
        assert "most recent call first" in log and "deep_in_user_code" in log, log


def test_timeout_while_ranks_start_dumps_their_stacks_and_says_they_were_starting(start_method):
    # The argument takes minutes to load on the rank: the timeout expires during the startup.
    t0 = time.monotonic()
    run = nbdist.launch(rankfns.takes_anything, rankfns.SlowToLoad(), nprocs=2, timeout=2, join=False)
    with pytest.raises(nbdist.RunTimeoutError) as info:
        run.wait(timeout=90)
    took = time.monotonic() - t0
    err = info.value
    print(f"{start_method}: timeout during startup -> error in {took:.2f} s: {str(err).splitlines()[0]}")
    assert "timed out after 2 s while ranks 0-1 were still starting" in str(err), str(err)
    assert set(err.failures) == {0, 1} and err.rank == 0
    assert set(read_rank_pids(run.run_dir)) == {0, 1}, "the ranks recorded themselves"
    for rank, failure in err.failures.items():
        # The dump's signal is not what ended the rank: the stop after it did.
        assert failure.exitcode != -STACK_DUMP_SIGNAL and "still starting when the timeout expired, " in failure.message
        assert failure.stack and "most recent call first" in failure.stack
        with open(os.path.join(run.run_dir, f"rank{rank}.stderr")) as fh:
            assert failure.stack in fh.read(), "the same stack is in the rank's log"
        if start_method == "warm":  # ready in milliseconds: the ranks are in the slow load by now
            assert "heavy_import_at_startup" in failure.stack and "heavy_import_at_startup" in str(err)
    assert took < 15


def test_every_byte_reaches_the_rank_logs():
    run = nbdist.launch(rankfns.write_everywhere, nprocs=2, join=False, init_process_group=False)
    assert run.wait(timeout=60) == {0: 0, 1: 1}
    for rank in (0, 1):
        with open(os.path.join(run.run_dir, f"rank{rank}.stdout")) as fh:
            out = fh.read()
        with open(os.path.join(run.run_dir, f"rank{rank}.stderr")) as fh:
            err = fh.read()
        assert f"python print from {rank}" in out
        assert f"c-level write from {rank}" in out
        assert f"subprocess echo from {rank}" in out
        assert f"python stderr from {rank}" in err
        assert [line for s, line in run.outputs[rank].lines if "c-level" in line]


def test_run_dir_is_private_and_the_store_listens_on_loopback_only():
    run = nbdist.launch(rankfns.hang, 10, nprocs=2, join=False)
    try:
        listening = [c for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]
        assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening), listening
        assert stat.S_IMODE(os.stat(run.run_dir).st_mode) == 0o700
        for folder, dirs, files in os.walk(run.run_dir):  # ranks/ holds each rank's registration
            for name in dirs:
                assert stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) == 0o700, name
            for name in files:
                assert stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) == 0o600, name
    finally:
        run.kill()
    assert run.status == "killed"


def test_context_manager_exit_stops_the_run():
    with nbdist.launch(rankfns.hang, nprocs=2, join=False, init_process_group=False) as run:
        wait_for(lambda: len(marked_pids(run.run_id)) == 2, 60, what="ranks up")
    assert run.status == "interrupted" and not marked_pids(run.run_id)


def test_a_peer_the_engine_took_down_with_the_dead_rank_is_never_named_first(tmp_path):
    """mpirun and srun kill a dead rank's peers within milliseconds and tell the kernel nothing; a
    kernel slower than that finds both gone in one look, the lower rank's exit first. The rank whose
    log holds faulthandler's "Fatal Python error" is the root cause; its tied peer was taken down."""
    import types

    from nbdist.errors import WorkerFailedError
    from nbdist.protocol import rundir
    from nbdist.run.events import RankStatus
    from nbdist.run.failure_report import collect_failures

    seen = time.time()
    with open(rundir.log_path(str(tmp_path), 1, "stderr"), "w") as fh:
        fh.write("step 3\nFatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n")
    open(rundir.log_path(str(tmp_path), 0, "stderr"), "w").close()
    run = types.SimpleNamespace(
        run_dir=str(tmp_path), engine_root=None, timed_out={}, unloadable={},
        ranks={r: RankStatus(r, "failed", pid=100 + r, exitcode=1) for r in (0, 1)},
        exit_seen={0: seen, 1: seen + 1e-5}, global_rank=lambda r: r,
        launcher=types.SimpleNamespace(name="mpirun", engine_log=lambda: ""))
    failures = collect_failures(run)
    err = WorkerFailedError(failures)
    assert err.rank == 1 and "rank 1 failed first" in str(err), str(err)
    assert failures[1].message == "Fatal Python error: Segmentation fault", failures[1]
    assert failures[0].secondary and failures[0].message == "stopped by mpirun after rank 1 failed", failures[0]
    # Seen a second apart, the order is known: the fatal log of a later one changes nothing.
    run.exit_seen = {0: seen, 1: seen + 1.0}
    assert WorkerFailedError(collect_failures(run)).rank == 0
