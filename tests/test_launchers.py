"""Engines that start the ranks themselves: real mpiexec (pip's mpich), same guarantees as spawn."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import pytest

import nbdist
import rankfns
from conftest import marked_pids, start_parent_with_loader_ranks, wait_for

MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed (pip install mpi4py mpich)")


@needs_mpi
def test_mpirun_gives_the_same_results_as_spawn():
    spawned = nbdist.launch(rankfns.rank_sum, nprocs=4)
    assert nbdist.launch(rankfns.rank_sum, nprocs=4, launcher="mpirun") == spawned == {r: 10.0 for r in range(4)}


@needs_mpi
def test_mpirun_ranks_have_torchrun_env_and_the_marker():
    out = nbdist.launch(rankfns.report_env, nprocs=2, launcher="mpirun")
    assert {v["env"]["RANK"] for v in out.values()} == {"0", "1"}
    assert all(v["marker_in_exec_env"] and v["backend"] == "gloo" for v in out.values())


@needs_mpi
def test_mpirun_fail_fast_names_the_rank():
    run = nbdist.launch(rankfns.fail_on, 2, "raise", nprocs=4, launcher="mpirun", join=False)
    with pytest.raises(nbdist.WorkerFailedError) as info:
        run.wait(timeout=90)
    assert info.value.rank == 2 and "boom on rank 2" in str(info.value)
    assert run.ended - run.ranks[2].ended < 4.0


@needs_mpi
def test_mpirun_interrupt_takes_the_engine_ranks_and_dataloader_workers(tmp_path):
    run = nbdist.launch(rankfns.sleep_with_loader, str(tmp_path), nprocs=2, launcher="mpirun", join=False,
                        init_process_group=False)
    wait_for(lambda: len([f for f in os.listdir(tmp_path) if f.startswith("ready.")]) == 2, 90, what="ranks ready")
    assert len(marked_pids(run.run_id)) >= 6, "engine, 2 ranks and 4 DataLoader workers"
    report = run.interrupt()
    assert run.status == "interrupted" and not report.survivors
    assert not marked_pids(run.run_id)


@needs_mpi
def test_mpirun_dead_parent_leaves_nothing(run_script, tmp_path):
    proc, run_id = start_parent_with_loader_ranks(run_script, tmp_path, launcher="mpirun")
    assert len(marked_pids(run_id)) >= 6
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    wait_for(lambda: not marked_pids(run_id), 3.0, what="engine, ranks and workers to die with their parent")
    print(f"mpirun: parent death -> nothing left in {time.monotonic() - t0:.2f} s")


def test_missing_engine_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    with pytest.raises(nbdist.LaunchConfigError, match=r"launcher='mpirun' needs mpiexec.*pip install 'nbdist\[mpi\]'"):
        nbdist.launch(lambda: 1, nprocs=2, launcher="mpirun")
