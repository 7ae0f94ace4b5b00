"""What the flight recorder and ``--check-collectives`` cost per collective, gloo on CPU ranks.

    .venv/bin/python benchmarks/bench_collectives.py [--nprocs 4] [--iters 300]

The same all_reduce loop, small (4 floats) and 1 MB, three ways in one run: one-shot ranks on
torch's own gloo group (``nbdist.launch``: no wrapper, no recorder, the baseline), a session's
ranks (the re-formable group's forwarding and the recorder), and the session with every
collective checked (a store round trip before each). Per collective: the median over ranks of
each rank's mean. Prints the times and the differences; it asserts nothing (goals, not tests).
"""

from __future__ import annotations

import argparse
import statistics

import nbdist

LOOP = """
def _loop(numel, iters):
    import time, torch, torch.distributed as dist
    x = torch.ones(numel)
    for _ in range(20):
        dist.all_reduce(x)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    return (time.perf_counter() - t0) / iters
"""


def _one_shot(numel: int, iters: int) -> float:
    namespace: dict = {}
    exec(LOOP, namespace)
    return statistics.median(nbdist.launch(namespace["_loop"], numel, iters, nprocs=ARGS.nprocs).values())


def _session(s, numel: int, iters: int, check: bool) -> float:
    s.execute(LOOP)
    out = s.execute(f"_loop({numel}, {iters})", check_collectives=check)
    return statistics.median(out.values())


def _recorder_alone(n: int = 20000) -> float:
    """The recorder's own CPU per collective: note it, and mark it done from its future."""
    import time

    import torch
    import torch.distributed as dist

    from nbdist.worker import flight_recorder

    class Work:  # a completed work, as gloo hands back
        def get_future(self):
            fut = torch.futures.Future()
            fut.set_result([x])
            return fut

    x, opts, work = torch.ones(4), dist.AllreduceOptions(), Work()
    t0 = time.perf_counter()
    for i in range(n):
        flight_recorder.watch_work(flight_recorder.record("bench", i, "allreduce", ([x], opts)), work)
    return (time.perf_counter() - t0) / n


def main() -> None:
    sizes = {"4 floats": 4, "1 MB": 2**18}
    rows = {}
    nbdist.warm(wait=True)
    for label, numel in sizes.items():
        rows[(label, "torch's gloo group (one-shot ranks)")] = _one_shot(numel, ARGS.iters)
    with nbdist.Session(nprocs=ARGS.nprocs) as s:
        s.wait_ready(120)
        for label, numel in sizes.items():
            rows[(label, "session: forwarding + recorder")] = _session(s, numel, ARGS.iters, False)
            rows[(label, "session, --check-collectives")] = _session(s, numel, ARGS.iters, True)
    print(f"all_reduce on {ARGS.nprocs} CPU ranks (gloo), {ARGS.iters} per measure, mean per collective")
    print(f"  the recorder alone (note + completion callback, one process): {_recorder_alone() * 1e6:.1f} us")
    for label in sizes:
        base = rows[(label, "torch's gloo group (one-shot ranks)")]
        for (size, way), seconds in rows.items():
            if size == label:
                print(f"  {label:<9} {way:<38} {seconds * 1e6:9.1f} us   +{(seconds - base) * 1e6:8.1f} us")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--iters", type=int, default=300)
    ARGS = parser.parse_args()
    main()
