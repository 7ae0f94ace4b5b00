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
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec not installed (pip install mpi4py mpich)")
    script = tmp_path / "attach_mpi.py"
    script.write_text(SCRIPT)
    out = subprocess.run([mpiexec, "-n", "4", sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    world = _check_world(out.stdout, 4)
    assert sorted(v[2] for v in world.values()) == [0, 1, 2, 3]
    assert "FAILED 1 {0: 7, 2: 7, 3: 7}" in out.stdout, out.stdout + out.stderr
