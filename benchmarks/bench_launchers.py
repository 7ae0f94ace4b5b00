"""Launch time of each engine launcher against the plain engine running a trivial script, same run.

    .venv/bin/python benchmarks/bench_launchers.py [--repeat 2] [--nprocs 4]

The trivial script does what a launched function does at the least: join a gloo group, one
all_reduce, leave. srun runs against a single-node Slurm started here on loopback (needs root
and slurm-wlm, as the tests do). Prints medians and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import torch
import torch.distributed as dist

import nbdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from clusters import SlurmCluster, slurm_missing  # noqa: E402

TRIVIAL = textwrap.dedent(
    """
    import os, datetime, torch, torch.distributed as dist
    rank = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or os.environ.get("SLURM_PROCID"))
    size = int(os.environ.get("WORLD_SIZE") or os.environ.get("PMI_SIZE") or os.environ.get("SLURM_NTASKS"))
    # torchrun gives MASTER_ADDR/PORT; mpiexec and srun runs get them from the benchmark.
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    """
)


def one_all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_command(engine: str, n: int, script: str) -> list[str]:
    py = [sys.executable, script]
    if engine == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), script]
    if engine == "mpirun":
        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
        return [mpiexec, "-n", str(n)] + py
    return ["srun", "-n", str(n), "--overcommit"] + py


def time_plain(engine: str, n: int, script: str) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    t0 = time.perf_counter()
    subprocess.run(plain_command(engine, n, script), check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def time_launch(engine: str, n: int) -> float:
    extra = {"launcher_args": ["--overcommit"]} if engine == "srun" else {}
    t0 = time.perf_counter()
    out = nbdist.launch(one_all_reduce, nprocs=n, launcher=engine, **extra)
    assert out == {r: float(n) for r in range(n)}
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--nprocs", type=int, default=4)
    opts = parser.parse_args()
    engines = ["torchrun"]
    if shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec"):
        engines.append("mpirun")
    cluster, base = None, None
    why = slurm_missing()
    if why is None:
        base = tempfile.mkdtemp(prefix="nbdist-bench-slurm-")
        cluster = SlurmCluster.start(base)
        os.environ.update(cluster.env)
        engines.append("srun")
    else:
        print(f"srun: skipped ({why})")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "trivial.py")
            with open(script, "w") as fh:
                fh.write(TRIVIAL)
            print(f"{'engine':10} {'plain engine (s)':>17} {'nbdist.launch (s)':>18} {'ratio':>6}   ({opts.nprocs} ranks)")
            for engine in engines:
                plain, ours = [], []
                for _ in range(opts.repeat):  # interleaved, so load on the box hits both alike
                    plain.append(time_plain(engine, opts.nprocs, script))
                    ours.append(time_launch(engine, opts.nprocs))
                p, o = statistics.median(plain), statistics.median(ours)
                print(f"{engine:10} {p:17.2f} {o:18.2f} {o / p:6.2f}")
    finally:
        if cluster is not None:
            cluster.stop()
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
