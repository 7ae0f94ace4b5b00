"""Attach: a process that already is a rank of a real torchrun or mpiexec world runs fn in place."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, nbdist, torch, torch.distributed as dist

    def where():
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        return (dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]), t.item(), os.getpid())

    if __name__ == "__main__":
        res = nbdist.launch(where)
        me = os.environ.get("RANK") or os.environ.get("PMI_RANK")
        print(f"RESULT {me} {res!r} {os.getpid()}\\n", end="", flush=True)  # one write: ranks share the pipe
        try:
            nbdist.launch(lambda: 1 / 0 if nbdist.rank() == 1 else 7)
        except nbdist.WorkerFailedError as e:
            if nbdist.rank() == 1:
                print(f"FAILED {e.rank} {e.results}\\n", end="", flush=True)
    """
)


def _results(out: str, n: int):
    lines = [line.split(" ", 2)[2].rsplit(" ", 1) for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == n, out
    return [(ast.literal_eval(res), int(pid)) for res, pid in lines]


def _run_under_mpiexec(tmp_path, source: str, n: int, timeout: float = 150) -> subprocess.CompletedProcess:
    """``mpiexec -n N python SCRIPT`` with pip's mpich; skips where there is no mpiexec."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec not installed (pip install mpi4py mpich)")
    script = tmp_path / "under_mpi.py"
    script.write_text(source)
    return subprocess.run([mpiexec, "-n", str(n), sys.executable, str(script)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _check_world(out: str, n: int):
    results = _results(out, n)
    first = results[0][0]
    assert all(res == first for res, _ in results), "every rank gets the same dict"
    assert sorted(first) == list(range(n))
    assert {res[0] for res in first.values()} == set(range(n))
    assert all(v[1] == n and v[3] == float(n) for v in first.values())
    # No new process: the value came from the very process that printed it.
    assert {v[4] for v in first.values()} == {pid for _, pid in results}
    return first


def test_torchrun_attach(tmp_path):
    script = tmp_path / "attach_torchrun.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    world = _check_world(out.stdout, 2)
    assert {v[2] for v in world.values()} == {0, 1}
    assert "FAILED 1 {0: 7}" in out.stdout, out.stdout + out.stderr


def test_mpi_attach_with_local_rank_from_shared_memory_split(tmp_path):
    out = _run_under_mpiexec(tmp_path, SCRIPT, 4, timeout=120)
    world = _check_world(out.stdout, 4)
    assert sorted(v[2] for v in world.values()) == [0, 1, 2, 3]
    assert "FAILED 1 {0: 7, 2: 7, 3: 7}" in out.stdout, out.stdout + out.stderr


def test_slurm_attach_under_srun(tmp_path, slurm):
    """A plain ``srun -n 4`` step (no PMI): the tasks meet at a store rank 0 hosts on a derived port."""
    script = tmp_path / "attach_slurm.py"
    script.write_text(SCRIPT)
    out = subprocess.run(["srun", "-n", "4", "--overcommit", sys.executable, str(script)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    world = _check_world(out.stdout, 4)
    assert sorted(v[2] for v in world.values()) == [0, 1, 2, 3]
    assert "FAILED 1 {0: 7, 2: 7, 3: 7}" in out.stdout, out.stdout + out.stderr


PER_KERNEL = textwrap.dedent(
    """
    import os, sys, nbdist
    sys.path.insert(0, {here!r})
    import rankfns

    if __name__ == "__main__":
        res = nbdist.launch(rankfns.report_world, nprocs=2)
        me = os.environ.get("PMI_RANK") or os.environ.get("RANK")
        print(f"RESULT {{me}} {{res!r}} {{os.getpid()}}\\n", end="", flush=True)
        try:
            nbdist.launch(rankfns.fail_on, 3, "raise", nprocs=2)
        except nbdist.WorkerFailedError as e:
            print(f"FAILED {{me}} {{e.rank}}\\n", end="", flush=True)
    """
)


def _check_per_kernel(out: str):
    results = _results(out, 2)
    first = results[0][0]
    assert all(res == first for res, _ in results), "every kernel gets every rank's value"
    assert sorted(first) == [0, 1, 2, 3]
    for rank, v in first.items():
        assert v["rank"] == rank and v["world_size"] == 4 and v["sum"] == 10.0
        assert v["local_rank"] == rank % 2 and v["group_rank"] == rank // 2, "global rank = kernel rank x N + local"
    # Both kernels name rank 3 as the root cause, whichever kernel it ran under.
    assert sorted(line.split()[2] for line in out.splitlines() if line.startswith("FAILED ")) == ["3", "3"], out


def test_nprocs_in_mpi_kernels_spawns_per_kernel(tmp_path):
    out = _run_under_mpiexec(tmp_path, PER_KERNEL.format(here=os.path.dirname(os.path.abspath(__file__))), 2)
    _check_per_kernel(out.stdout + out.stderr)


def test_nprocs_in_slurm_kernels_spawns_per_kernel(tmp_path, slurm):
    script = tmp_path / "per_kernel_slurm.py"
    script.write_text(PER_KERNEL.format(here=os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(["srun", "-n", "2", "--overcommit", sys.executable, str(script)], capture_output=True,
                         text=True, timeout=150, env=dict(os.environ, OMP_NUM_THREADS="1"))
    _check_per_kernel(out.stdout + out.stderr)


def test_nprocs_in_torchrun_kernels_spawns_per_kernel(tmp_path):
    script = tmp_path / "per_kernel_torchrun.py"
    script.write_text(PER_KERNEL.format(here=os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=dict(os.environ, OMP_NUM_THREADS="1"))
    _check_per_kernel(out.stdout + out.stderr)


MAGIC_UNDER_MPI = textwrap.dedent(
    """
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    shell.user_ns["scale"] = 10
    cell = "import torch.distributed as dist\\nprint('hello from', dist.get_rank())\\ndist.get_rank() * scale\\n"
    # --nprocs in a kernel that is an MPI rank: this kernel spawns 2 ranks of a world of 4.
    shell.run_cell_magic("distributed", "--nprocs 2 --view text", cell)
    # One write per line: the two kernels share the pipe.
    print(f"RESULTS {dict(shell.user_ns['_dist'].results)}\\n", end="", flush=True)
    # Without --nprocs the kernel itself is the rank (in-process attach).
    value = shell.run_cell_magic("distributed", "", "import torch.distributed as dist\\ndist.get_world_size()")
    print(f"ATTACHED {value}\\n", end="", flush=True)
    """
)


def test_magic_in_kernels_under_mpi(tmp_path):
    out = _run_under_mpiexec(tmp_path, MAGIC_UNDER_MPI, 2)
    text = out.stdout + out.stderr
    # Each kernel shows its own ranks live: kernel 0 ranks 0-1, kernel 1 ranks 2-3.
    for rank in range(4):
        assert f"[rank {rank}] hello from {rank}" in text, text
    assert text.count("RESULTS {0: 0, 1: 10}") == 1 and text.count("RESULTS {2: 20, 3: 30}") == 1, text
    assert text.count("ATTACHED 2") == 2, text


STOP_THEN_CELLS = textwrap.dedent(
    """
    import os, signal, time, nbdist

    def stopped_on_kernel_1():
        if nbdist.rank() == 1:
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGINT)  # the stop button, in kernel 1 only
            time.sleep(60)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:  # kernel 0: a long cell, ended by kernel 1's stop
            time.sleep(0.01)
        return "ran to the end"

    if __name__ == "__main__":
        me = int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID"))
        t0 = time.monotonic()
        try:
            nbdist.launch(stopped_on_kernel_1)
            print(f"NOT-STOPPED {me}\\n", end="", flush=True)
        except KeyboardInterrupt:
            print(f"STOPPED-HERE {me} {time.monotonic() - t0:.1f}\\n", end="", flush=True)
        except nbdist.RunStoppedError as e:
            print(f"STOPPED-PEER {me} {time.monotonic() - t0:.1f} {e}\\n", end="", flush=True)
        for i in range(3):
            res = nbdist.launch(lambda: (nbdist.rank(), i))
            print(f"CELL {me} {i} {res!r}\\n", end="", flush=True)
        from nbdist.launchers.attach import KEEP, slurm_meeting_point

        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        derived = slurm_meeting_point(env)[1] if "SLURM_JOB_ID" in env else None
        print(f"SIGNED {me} {KEEP['comm'].key is not None} {os.environ.get('MASTER_PORT')} {derived}\\n", end="", flush=True)
    """
)


def _check_stop_then_cells(text: str):
    lines = text.splitlines()
    here = [line.split() for line in lines if line.startswith("STOPPED-HERE ")]
    peer = [line.split(" ", 3) for line in lines if line.startswith("STOPPED-PEER ")]
    assert [h[1] for h in here] == ["1"] and [p[1] for p in peer] == ["0"], text
    assert "stopped on node 1 (KeyboardInterrupt there)" in peer[0][3], text
    print(f"kernel 1 stopped; kernel 0's cell ended {peer[0][2]} s after it began")
    assert float(peer[0][2]) < 10, "kernel 0's long cell was ended by kernel 1's stop, not run to its end"
    for me in (0, 1):
        for i in range(3):
            assert f"CELL {me} {i} {{0: (0, {i}), 1: (1, {i})}}" in lines, text
    signed = [line.split() for line in lines if line.startswith("SIGNED ")]
    assert len(signed) == 2 and all(s[2] == "True" for s in signed), "the kernels agreed a key through ~/.nbdist"
    return signed


def test_a_stop_in_one_torchrun_kernel_ends_the_round_and_later_cells_agree(tmp_path):
    """A stop in one attached kernel used to skip its gather: its round counter lagged its peers'
    for the rest of its life, the peers waited out the store's timeout, and later cells read the
    previous round's keys."""
    script = tmp_path / "stop_then_cells.py"
    script.write_text(STOP_THEN_CELLS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    _check_stop_then_cells(out.stdout + out.stderr)


def test_a_stop_in_one_slurm_kernel_ends_the_round_and_later_cells_agree(tmp_path, slurm):
    script = tmp_path / "stop_then_cells_slurm.py"
    script.write_text(STOP_THEN_CELLS)
    out = subprocess.run(["srun", "-n", "2", "--overcommit", sys.executable, str(script)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    signed = _check_stop_then_cells(out.stdout + out.stderr)
    # Task 0 hosted the step's store on a free port, not the one derived from the job and step ids.
    assert all(s[3] != s[4] and s[4] != "None" for s in signed), signed
