"""Rich output from a session's ranks, as a notebook gets it: a real kernel (jupyter_client), the default view.

    .venv/bin/python benchmarks/bench_rich_output.py [--only flood|plots] [--nprocs 16] [--steps 500]

1. **A flood.** A 2-rank session whose ranks loop on ``display(HTML('<b>x</b>' * 20000))`` (240 KB a
   bundle) gets the stop button 2 s in. Measured: the seconds from the stop to the stopped cell's reply,
   and to the reply of the next cell (a gloo all_reduce); the IOPub messages and MB a client drained
   and the largest message; the kernel's RSS. Baseline from the same run: the same loop as a plain cell
   of the same kernel (no nbdist), stopped the same way.
2. **Plots.** An N-rank session whose ranks each draw and ``plt.show()`` a small figure per step for S
   steps. The kernel's RSS, sampled every 0.2 s: before the cell, its peak, after it; the IOPub MB.
   Baseline from the same run: the kernel's RSS before the session started.

Every wait has a cap (``--cap``): a run that hangs says so instead of hanging the benchmark. An older
checkout is measured with ``PYTHONPATH=/path/to/it``. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

FLOOD = "from IPython.display import display, HTML\nfor i in range(10**6):\n    display(HTML('<b>x</b>' * 20000))"
ALL_REDUCE = "%%distributed --view text\nt = torch.ones(1); dist.all_reduce(t); t.item()"


class Drain:
    """What IOPub carried (an ``on_message`` for :meth:`Kernel.collect`): messages, bytes, the largest."""

    def __init__(self):
        self.messages = 0
        self.nbytes = 0
        self.largest = 0

    def __call__(self, msg) -> None:
        size = len(json.dumps(msg["content"]))
        self.messages, self.nbytes, self.largest = self.messages + 1, self.nbytes + size, max(self.largest, size)

    def until_idle(self, k, msg_id: str, cap: float) -> float | None:
        """Seconds until ``msg_id`` is idle, or None past ``cap`` (checked on every message: a flood keeps
        the channel busy)."""
        try:
            return k.collect(msg_id, timeout=cap, on_message=self).seconds
        except queue.Empty:
            return None

    def drain_for(self, k, seconds: float) -> None:
        self.until_idle(k, "-", seconds)

    def __str__(self) -> str:
        return f"IOPub {self.messages:,} messages, {self.nbytes / 1e6:,.1f} MB, largest {self.largest / 1e6:.2f} MB"


def _rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def _said(seconds: float | None, cap: float) -> str:
    return f"{seconds:.2f} s" if seconds is not None else f"not within {cap:.0f} s"


def _stop_a_flood(k, code: str, cap: float) -> tuple[float | None, Drain]:
    drain = Drain()
    msg_id = k.send(code)
    drain.drain_for(k, 2.0)
    k.km.interrupt_kernel()
    return drain.until_idle(k, msg_id, cap), drain


def measure_flood(cap: float) -> None:
    from kernel_client import Kernel

    k = Kernel()
    try:
        k.run("%load_ext nbdist")
        assert k.run("%dist_start -n 2").status == "ok"
        assert k.run("%%distributed\nimport torch, torch.distributed as dist\nx = 1").status == "ok"
        plain, plain_drain = _stop_a_flood(k, FLOOD, cap)
        print(f"plain cell's flood, stopped 2 s in: idle after {_said(plain, cap)}; {plain_drain}")
        stopped, drain = _stop_a_flood(k, "%%distributed\n" + FLOOD, cap)
        print(f"session cell's flood (2 ranks), stopped 2 s in: idle after {_said(stopped, cap)}; {drain}")
        t0 = time.monotonic()
        nxt = Drain().until_idle(k, k.send(ALL_REDUCE), cap)
        print(f"next cell (all_reduce): replied after {_said(nxt, cap)}; stop -> next cell's reply "
              f"{_said(None if nxt is None or stopped is None else stopped + time.monotonic() - t0, cap)}")
        print(f"kernel RSS {_rss_mb(k.pid):,.0f} MB")
    finally:
        k.km.shutdown_kernel(now=True)  # a hung kernel would not answer a polite one


def measure_plots(nprocs: int, steps: int, cap: float) -> None:
    from kernel_client import Kernel

    k = Kernel()
    try:
        k.run("%load_ext nbdist")
        before_session = _rss_mb(k.pid)
        assert k.run(f"%dist_start -n {nprocs}", timeout=cap).status == "ok"
        setup = ("%%distributed\nimport matplotlib\nimport matplotlib.pyplot as plt\nimport torch.distributed as dist")
        assert k.run(setup, timeout=cap).status == "ok"
        before, peak, stop = _rss_mb(k.pid), [0.0], threading.Event()

        def sample():
            while not stop.wait(0.2):
                peak[0] = max(peak[0], _rss_mb(k.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = ("%%distributed\nfor step in range(" + str(steps) + "):\n"
                "    fig = plt.figure(figsize=(3, 2), dpi=60)\n    plt.plot([step, step + dist.get_rank(), 1])\n"
                "    plt.title(f'step {step}')\n    plt.show()\n")
        drain, t0 = Drain(), time.monotonic()
        took = drain.until_idle(k, k.send(code), cap)
        stop.set()
        sampler.join()
        after = _rss_mb(k.pid)
        print(f"{nprocs} ranks x {steps} plots: cell {_said(took, cap)} ({time.monotonic() - t0:.1f} s); kernel RSS "
              f"{before_session:,.0f} MB before the session, {before:,.0f} MB before the cell, peak {peak[0]:,.0f} MB, "
              f"after {after:,.0f} MB; {drain}")
        k.run("%dist_stop", timeout=cap)
    finally:
        k.km.shutdown_kernel(now=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["flood", "plots"])
    parser.add_argument("--nprocs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--cap", type=float, default=120.0)
    args = parser.parse_args()
    import nbdist

    print(f"nbdist from {os.path.dirname(nbdist.__file__)}")
    if args.only in (None, "flood"):
        measure_flood(args.cap)
    if args.only in (None, "plots"):
        measure_plots(args.nprocs, args.steps, args.cap)


if __name__ == "__main__":
    main()
