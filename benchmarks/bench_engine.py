"""Engine timings against torch's own spawn, measured in the same run.

    .venv/bin/python benchmarks/bench_engine.py [--repeat 3]

Prints medians and ratios; it asserts nothing (goals, not tests).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nbdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import rankfns  # noqa: E402


def one_all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _baseline_rank(i, n, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=i, world_size=n)
    one_all_reduce()
    dist.destroy_process_group()


def time_torch_spawn(n):
    with socket.socket() as s:  # the baseline's usual bind-then-close port pick
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    mp.start_processes(_baseline_rank, args=(n, port), nprocs=n, join=True, start_method="spawn")
    return time.perf_counter() - t0


def time_launch(n):
    t0 = time.perf_counter()
    nbdist.launch(one_all_reduce, nprocs=n)
    return time.perf_counter() - t0


def time_interrupt(n):
    ready = tempfile.mkdtemp()
    run = nbdist.launch(rankfns.sleep_with_loader, ready, nprocs=n, join=False, init_process_group=False)
    while len([f for f in os.listdir(ready) if f.startswith("ready.")]) < n:
        time.sleep(0.05)
    t0 = time.perf_counter()
    report = run.interrupt()
    while nbdist.ps(run.run_id):
        time.sleep(0.01)
    return time.perf_counter() - t0, report


def time_fail_fast(n):
    run = nbdist.launch(rankfns.fail_on, 2, "raise", 0.5, nprocs=n, join=False)
    try:
        run.wait()
    except nbdist.WorkerFailedError as err:
        raised = time.time()
        return raised - err.failures[2].time, err.rank
    raise AssertionError("the run did not fail")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--nprocs", type=int, default=4)
    a = ap.parse_args()
    n = a.nprocs
    base = [time_torch_spawn(n) for _ in range(a.repeat)]
    ours = [time_launch(n) for _ in range(a.repeat)]
    stops = [time_interrupt(n) for _ in range(a.repeat)]
    fails = [time_fail_fast(n) for _ in range(a.repeat)]
    out = {
        "nprocs": n,
        "cores": os.cpu_count(),
        "torch_spawn_s": statistics.median(base),
        "launch_s": statistics.median(ours),
        "launch_over_torch_spawn": statistics.median(ours) / statistics.median(base),
        "interrupt_to_nothing_left_s": statistics.median(t for t, _ in stops),
        "interrupt_report": str(stops[-1][1]),
        "fail_fast_s": statistics.median(t for t, _ in fails),
        "fail_fast_root_cause_ranks": [r for _, r in fails],
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
