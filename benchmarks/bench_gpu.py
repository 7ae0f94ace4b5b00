"""A short GPU benchmark (what scripts/gpu-check.sh runs on a GPU machine; no IPython needed).

Times, on this machine's GPUs: a fresh 1-rank run on the GPU forked from the warm template beside
the same run spawned (the baseline) in the same process; a session's trivial cell and one NCCL
all_reduce; and the stop button on a loop of GPU steps, to idle ranks with their state kept.
Medians; prints one table.
"""

from __future__ import annotations

import statistics
import sys
import time

import nbdist


def on_gpu():
    import torch
    import torch.distributed as dist

    t = torch.ones(1 << 10, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return t[0].item()


def timed(fn, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> int:
    import torch

    gpus = torch.cuda.device_count()
    if not gpus:
        print("no CUDA GPU here: nothing to measure")
        return 0
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {gpus} GPU(s): {torch.cuda.get_device_name(0)}")
    t0 = time.perf_counter()
    nbdist.warm(wait=True)
    rows = [("warm template ready", time.perf_counter() - t0)]
    rows.append(("fresh 1-rank GPU run, spawned (baseline)",
                 timed(lambda: nbdist.launch(on_gpu, nprocs=1, start_method="spawn"), 3)))
    rows.append(("fresh 1-rank GPU run, warm", timed(lambda: nbdist.launch(on_gpu, nprocs=1, start_method="warm"), 5)))
    n = min(gpus, 8)
    with nbdist.Session(nprocs=n) as s:
        s.wait_ready(300)
        s.execute("import torch, torch.distributed as dist\nt = torch.ones(1 << 10, device='cuda')\n"
                  "w = torch.randn(4096, 4096, device='cuda')")
        rows.append((f"session cell 'x = 1' ({n} ranks)", timed(lambda: s.execute("x = 1"), 20)))
        rows.append((f"session cell, one NCCL all_reduce ({n} ranks)",
                     timed(lambda: s.execute("dist.all_reduce(t)\ntorch.cuda.synchronize()"), 20)))
        stops = []
        for _ in range(3):
            cell = s.execute("while True:\n    y = w @ w\n    dist.all_reduce(y)\n    torch.cuda.synchronize()",
                             join=False)
            time.sleep(1.0)
            t1 = time.perf_counter()
            cell.interrupt()
            try:
                cell.wait(60)
            except nbdist.RunStoppedError:
                pass
            stops.append(time.perf_counter() - t1)
        rows.append((f"stop button in GPU steps -> idle, state kept ({n} ranks)", statistics.median(stops)))
    for label, seconds in rows:
        print(f"  {label:<58} {seconds * 1e3:9.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
