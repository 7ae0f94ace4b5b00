"""Warm start against the baselines, measured in the same run.

    .venv/bin/pip install -e '.[bench]'      # accelerate: the notebook_launcher baseline
    .venv/bin/python benchmarks/bench_warm.py [--repeat 5] [--nprocs 4]

Through a real kernel (jupyter_client): a fresh ``%%distributed -n 4`` cell with one all_reduce on
warm ranks in the default view (and in the text view; the first cell after ``%load_ext nbdist``
once warm-up is done, then the median of the next), beside ``torch.multiprocessing.spawn`` of the
same work called in that kernel and a plain cell, in rounds that run each once in a shuffled
order. Outside a kernel: Accelerate's ``notebook_launcher`` (it forks), ``nbdist.launch`` from a
plain script after warm-up, and the memory (PSS) of 4 warm ranks against 4 spawned ranks.
Prints medians and ratios; it asserts nothing (goals, not tests).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

WORK = '''
import time, torch, torch.distributed as dist

def one_all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

def spawned(i, n, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=i, world_size=n)
    one_all_reduce()
    dist.destroy_process_group()

def under_accelerate():
    dist.init_process_group("gloo")
    one_all_reduce()
    dist.destroy_process_group()

def hold(seconds):
    time.sleep(seconds)
    return 0
'''


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_kernel(n: int, repeat: int, workdir: str) -> dict:
    from kernel_client import Kernel

    k = Kernel(env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=workdir))
    try:
        assert k.run("%load_ext nbdist").status == "ok"
        k.run("from nbdist.warmstart.handle import current_template\ncurrent_template().wait_ready(120)")
        k.run("import benchwork, torch.multiprocessing as mp")
        cell = f"%%distributed -n {n}{{}}\nimport torch, torch.distributed as dist\n" \
               "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
        first = k.run(cell.format(""))  # the default view: what a notebook user gets
        assert first.status == "ok" and first.result == f"{float(n)}", first.error_text or first.stdout
        cells = {"warm": lambda: cell.format(""), "text": lambda: cell.format(" --view text"), "plain": lambda: "x = 1",
                 "spawn": lambda: f"mp.spawn(benchwork.spawned, args=({n}, {_free_port()}), nprocs={n})"}
        out = {name: [] for name in cells}
        # Rounds, each cell once in a seeded shuffled order: the box's drift weighs on all alike.
        for i in range(repeat):
            order = list(cells)
            random.Random(i).shuffle(order)
            for name in order:
                res = k.run(cells[name]())
                assert res.status == "ok", res.error_text
                out[name].append(res.seconds)
        return {"first": first.seconds, **out}
    finally:
        k.shutdown()


def _script(workdir: str, body: str) -> float:
    """Run ``body`` in a fresh interpreter; it prints one number (seconds) last."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True,
                         cwd=workdir, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=workdir), timeout=600)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return [float(x) for x in out.stdout.strip().splitlines()[-1].split()]


def bench_scripts(n: int, repeat: int, workdir: str) -> dict:
    accelerate = _script(workdir, f"""
        import time, benchwork
        from accelerate import notebook_launcher
        times = []
        for _ in range({repeat}):
            t0 = time.perf_counter()
            notebook_launcher(benchwork.under_accelerate, num_processes={n})
            times.append(time.perf_counter() - t0)
        print(*times)
    """)
    launch = _script(workdir, f"""
        import time, nbdist, benchwork
        nbdist.warm(wait=True)
        times = []
        for _ in range({repeat}):
            t0 = time.perf_counter()
            nbdist.launch(benchwork.one_all_reduce, nprocs={n})
            times.append(time.perf_counter() - t0)
        print(*times)
    """)
    pss = _script(workdir, f"""
        import time, psutil, nbdist, benchwork
        nbdist.warm(wait=True)
        def pss(run):
            time.sleep(3)  # past start-up: what a rank holds while it works
            return sum(psutil.Process(p).memory_full_info().pss for p in run.pids.values())
        out = []
        for method in ("warm", "spawn"):
            run = nbdist.launch(benchwork.hold, 60, nprocs={n}, start_method=method, join=False)
            while len(run.pids) < {n} or any(st.status == "starting" for st in run.ranks.values()):
                time.sleep(0.05)
            time.sleep(6 if method == "spawn" else 0)  # spawned ranks import torch first
            out.append(pss(run) / 2**20)
            run.kill()
        print(*out)
    """)
    return {"accelerate": accelerate, "launch": launch, "pss_warm": pss[0], "pss_spawn": pss[1]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--nprocs", type=int, default=4)
    args = parser.parse_args()
    n, med = args.nprocs, statistics.median
    workdir = tempfile.mkdtemp(prefix="nbdist-bench-")
    with open(os.path.join(workdir, "benchwork.py"), "w") as fh:
        fh.write(WORK)
    k = bench_kernel(n, args.repeat, workdir)
    s = bench_scripts(n, args.repeat, workdir)
    warm = med(k["warm"])
    print(f"{n} ranks, one gloo all_reduce, medians of {args.repeat}")
    print(f"  kernel: first %%distributed cell after %load_ext (warm-up done)  {k['first'] * 1e3:8.1f} ms")
    print(f"  kernel: %%distributed cell, warm ranks, default view              {warm * 1e3:8.1f} ms")
    print(f"  kernel: the same, --view text                                     {med(k['text']) * 1e3:8.1f} ms")
    print(f"  kernel: plain 'x = 1' cell                                        {med(k['plain']) * 1e3:8.1f} ms")
    print(f"  kernel: torch.multiprocessing.spawn cell                          {med(k['spawn']) * 1e3:8.1f} ms"
          f"   warm is {med(k['spawn']) / warm:5.1f}x faster (goal >= 50x, floor 30x)")
    print(f"  script: accelerate.notebook_launcher (fork)                       {med(s['accelerate']) * 1e3:8.1f} ms"
          f"   warm cell / notebook_launcher = {warm / med(s['accelerate']):4.2f} (goal <= 1)")
    print(f"  script: nbdist.launch after warm-up                               {med(s['launch']) * 1e3:8.1f} ms")
    print(f"  memory: PSS of {n} warm ranks {s['pss_warm']:7.0f} MiB, of {n} spawned ranks {s['pss_spawn']:7.0f} MiB"
          f"   ratio {s['pss_warm'] / s['pss_spawn']:4.2f}")


if __name__ == "__main__":
    main()
