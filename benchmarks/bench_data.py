"""Data in and out of session ranks: push, pull, scatter and gather of a 256 MB float tensor on 4 ranks.

Beside, in the same run: one memcpy of the same tensor (``clone``) times the ranks (the floor: each
rank's value is its own), and ipyparallel's ``push``/``pull`` of the same data as a numpy array to 4
engines (``pip install -e '.[bench]'``; skipped without it). Medians of 3.

    .venv/bin/python benchmarks/bench_data.py
"""

from __future__ import annotations

import statistics
import time

import torch

import nbdist

N, MB = 4, 256


def timed(fn, n=3):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    big = torch.randn(MB * 2**20 // 4)
    rows = {"one memcpy (clone)": timed(lambda: big.clone())}
    rows[f"{N} memcpys (the floor: a copy per rank)"] = rows["one memcpy (clone)"] * N
    nbdist.warm(wait=True)
    with nbdist.Session(nprocs=N) as s:
        s.wait_ready(120)
        s.execute("import torch")
        rows[f"Session.push to {N} ranks"] = timed(lambda: s.push(big=big))
        s.execute("big = big + 0")  # each rank touches every page of its own copy
        rows[f"Session.pull from {N} ranks"] = timed(lambda: s.pull("big"))
        rows[f"Session.scatter over {N} ranks"] = timed(lambda: s.scatter("piece", big))
        rows[f"Session.gather from {N} ranks"] = timed(lambda: s.gather("piece"))
    try:
        import ipyparallel as ipp
    except ImportError:
        ipp = None
    if ipp is not None:
        array = big.numpy()
        with ipp.Cluster(n=N, log_level=40) as rc:
            view = rc[:]
            rows[f"ipyparallel push to {N} engines"] = timed(lambda: view.push({"big": array}, block=True))
            rows[f"ipyparallel pull from {N} engines"] = timed(lambda: view.pull("big", block=True))
    base = rows[f"{N} memcpys (the floor: a copy per rank)"]
    print(f"{MB} MB float32, {N} ranks, medians of 3")
    for label, seconds in rows.items():
        print(f"  {label:<40} {seconds:7.3f} s   {seconds / base:5.2f}x the floor")
    if ipp is not None:
        for way in ("push", "pull"):
            mine = rows[f"Session.{way} {'to' if way == 'push' else 'from'} {N} ranks"]
            theirs = rows[f"ipyparallel {way} {'to' if way == 'push' else 'from'} {N} engines"]
            print(f"  {way}: {theirs / mine:.1f}x faster than ipyparallel (goal >= 3x)")


if __name__ == "__main__":
    main()
