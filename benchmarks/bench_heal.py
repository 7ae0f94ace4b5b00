"""A rank's death to a healed, idle session, against the baselines from the same run, through a real kernel.

    .venv/bin/python benchmarks/bench_heal.py [--mb 100] [--nprocs 4] [--repeat 3] [--victim R] [--restart]

One kernel (jupyter_client), as users have it, with a live warm session: a DDP model of ``--mb`` MB of
float32 parameters and Adam (its two moments: three times that per rank), trained a few steps. Each
repeat SIGKILLs one rank (``--victim``, rank 2 of 4 by default) while idle and times, from the kill:

* *degraded*: until the session says so (the survivors told which rank their groups lack);
* *healed*: until ``%dist_heal`` returned and the session is idle, every rank in step; with the
  heal's own phases (start, re-form, copy);

and checks that every survivor holds the same names with the same fingerprints as before the death.

Baselines, in the same run:

* ``memcpy``: one copy of one rank's state (parameters and Adam's moments) in this process: what moving
  the state once costs at memory speed. The goal for 1 GB is a heal within 5x of it.
* ``--restart``: ``%dist_restart``, then the setup cell and the training cells that built the same
  state again: what a user did before the heal (goal: the heal at least 5x faster).

Prints medians and ratios; asserts nothing (goals, not tests).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

SESSION = "from nbdist.frontend.session_magics import live_session as _ls\n_s = _ls()\n"


def setup_cell(mb: int) -> str:
    rows = max(1, int(mb * 2**20 / 4 / 1024))
    return (f"%%distributed --view text\nimport torch, torch.distributed as dist\ntorch.manual_seed(0)\n"
            f"model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1024, {rows}, bias=False))\n"
            f"opt = torch.optim.Adam(model.parameters(), lr=1e-3)\nx = torch.randn(4, 1024)\n"
            f"def step():\n    opt.zero_grad()\n    model(x).sum().backward()\n    opt.step()\n")


TRAIN = "%%distributed --view text\nfor _ in range(3):\n    step()"
PRINTS = ("%%distributed --view text --ranks {r}\nfrom nbdist.worker.namespace_copy import fingerprint_names\n"
          "sorted(fingerprint_names().items())")


def _value(k, code: str):
    res = k.run(code, timeout=600)
    if res.status != "ok":
        raise RuntimeError(res.error_text + res.stdout)
    return res.result


def _wait(k, status: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _value(k, SESSION + "_s.status").strip("'") != status:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the session did not become {status}")
        time.sleep(0.02)


def memcpy_seconds(mb: int) -> float:
    import numpy as np

    state = np.ones(3 * mb * 2**20 // 4, dtype=np.float32)  # parameters and Adam's two moments
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        state.copy()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    from conftest import nbdist_kernel

    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--victim", type=int, default=None, help="the rank killed (default: nprocs // 2)")
    ap.add_argument("--restart", action="store_true", help="also time %%dist_restart plus the cells again")
    args = ap.parse_args()
    victim = args.nprocs // 2 if args.victim is None else args.victim
    degraded, healed, phases, same = [], [], [], []
    with nbdist_kernel("warm") as k:
        _value(k, f"%dist_start -n {args.nprocs}\n1")
        _value(k, setup_cell(args.mb) + "\n1")
        _value(k, TRAIN + "\n1")
        for _ in range(args.repeat):
            survivors = [r for r in range(args.nprocs) if r != victim]
            before = {r: _value(k, PRINTS.format(r=r)) for r in survivors}
            pid = int(_value(k, SESSION + f"_s.pids[{victim}]"))
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            _wait(k, "degraded")
            degraded.append(time.monotonic() - t0)
            said = k.run("%dist_heal", timeout=600)
            _wait(k, "idle")
            healed.append(time.monotonic() - t0)
            phases.append(said.stdout.splitlines()[0] if said.stdout else said.error_text)
            after = {r: _value(k, PRINTS.format(r=r)) for r in survivors}
            same.append(before == after)
        restart = None
        if args.restart:
            t0 = time.monotonic()
            _value(k, "%dist_restart\n1")
            _value(k, setup_cell(args.mb) + "\n1")
            _value(k, TRAIN + "\n1")
            restart = time.monotonic() - t0
        _value(k, "%dist_stop\n1")
    copy = memcpy_seconds(args.mb)
    heal = statistics.median(healed)
    print(f"bench_heal: {args.nprocs} ranks, warm, a {args.mb} MB DDP model + Adam, "
          f"{args.repeat} deaths of rank {victim}")
    print(f"  kill -> degraded      {statistics.median(degraded) * 1000:8.0f} ms (median)")
    print(f"  kill -> healed, idle  {heal * 1000:8.0f} ms (median; goal at 100 MB: within 2000 ms)")
    print(f"  memcpy of one rank's state ({3 * args.mb} MB) {copy * 1000:8.1f} ms; heal / memcpy = {heal / copy:.1f}x")
    if restart is not None:
        print(f"  %dist_restart + setup + training cells {restart * 1000:8.0f} ms; restart / heal = {restart / heal:.1f}x "
              f"(goal: at least 5x)")
    print(f"  survivors' names and fingerprints unchanged after every heal: {all(same)}")
    print(f"  the last heal said: {phases[-1]}")


if __name__ == "__main__":
    main()
