"""Session cells against the baselines, measured in the same run, through real kernels.

    .venv/bin/pip install -e '.[bench]'      # ipyparallel: the %px baseline
    .venv/bin/python benchmarks/bench_session.py [--repeat 30] [--nprocs 4]

Two kernels (jupyter_client), as users have them: one with a live 4-rank session, one with
ipyparallel's 4 engines; both are up for the whole comparison. They are driven in alternating
blocks of rounds, each round running each of its kernel's cells once in a shuffled order (seeded):
in the nbdist kernel a plain ``x = 1`` cell and ``%%distributed`` cells (a trivial statement in the
default view and in the text view, one gloo all_reduce); in the ipyparallel kernel a plain cell and
``%px`` of the trivial statement and of a local tensor op. Each kernel's plain cell is its own
baseline. Then, in the nbdist kernel, the stop button on a busy session cell (time until the ranks
are idle, state kept), the stop button while a rank waits in DDP's gradient all-reduce for a peer
that sleeps (released, the group re-formed in place), a rank that raises while its peers wait in a
collective (time until the error shows), what the re-formable group's forwarding costs per
collective, and the CPU that an idle session's ranks use; and what ``%autoreload`` costs a session
cell whose ranks imported 200 modules of the user's (``--autoreload-only`` measures that alone, without
ipyparallel). Prints medians and ratios; it asserts nothing (goals, not tests).

Why two kernels: in one kernel each system's cells paid for the other's leftover work (ipyparallel's
client thread still taking the engines' replies when the next cell began holds that kernel's GIL),
which no user has; blocks alternate so that a drift of this 2-core box weighs on both alike.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _times(k, code: str, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        res = k.run(code)
        assert res.status == "ok", res.error_text or res.stderr
        out.append(res.seconds)
    return out


def _stop_times(k, cell: str, says: str, repeat: int) -> list[float]:
    """Send ``cell``, press the stop button 0.5 s later: the seconds until the kernel answered
    (saying ``says``), each time."""
    took = []
    for _ in range(repeat):
        msg = k.send(cell)
        time.sleep(0.5)
        t0 = time.monotonic()
        k.km.interrupt_kernel()
        res = k.collect(msg, timeout=30)
        assert res.status == "error" and says in res.error_text, res.error_text
        took.append(time.monotonic() - t0)
    return took


def _rounds(k, cells: dict, times: dict, first: int, count: int) -> None:
    """``count`` rounds in kernel ``k``, each running every cell once in a seeded shuffled order;
    the block's first round only warms up (the other kernel ran last)."""
    for i in range(first, first + count):
        order = list(cells)
        random.Random(i).shuffle(order)
        for name in order:
            took = _times(k, cells[name], 1)[0]
            if i > first:
                times[name].append(took)


def _autoreload_cost(k, n: int, repeat: int, modules: int = 200) -> dict:
    """``%dist_autoreload`` on and off, paired cell by cell, in the live session of kernel ``k`` whose
    ranks imported ``modules`` modules of the user's; and the rank-side check alone, timed on the ranks."""
    import tempfile

    where = tempfile.mkdtemp(prefix="nbdist-bench-autoreload-")
    for i in range(modules):
        with open(os.path.join(where, f"bench_user_mod_{i}.py"), "w") as fh:
            fh.write(f"def f():\n    return {i}\n\nclass C:\n    def m(self):\n        return {i}\n")
    res = k.run(f"%%distributed --view text\nimport sys, importlib\nsys.path.insert(0, {where!r})\n"
                f"for _i in range({modules}):\n    importlib.import_module(f'bench_user_mod_{{_i}}')")
    assert res.status == "ok", res.error_text
    # On rank 0 alone (the others idle): the check a rank on another machine makes before a cell (a stat
    # per watched module; the kernel makes it for ranks on its machine), and the scan after a cell that
    # imported something.
    res = k.run("%%distributed --view text --ranks 0\nimport time as _t\nfrom nbdist.worker import autoreload as _ar\n"
                "from nbdist.protocol.session_channel import Autoreload as _A\n_rule = _A()\n"
                "def _per(fn, m=500):\n    t0 = _t.perf_counter()\n    for _ in range(m):\n        fn()\n"
                "    return (_t.perf_counter() - t0) / m\n"
                "def _scan():\n    _ar._COUNT = -1\n    _ar.track()\n"
                "(len(_ar.watched()), len(sys.modules), _per(lambda: _ar.reload_changed(_rule)), _per(_scan, 100))")
    assert res.status == "ok", res.error_text
    watched, in_sys, check, scan = eval(res.result)
    # In the kernel: its check for the ranks on its machine (a stat per file the ranks reported).
    res = k.run("import time as _t\nfrom nbdist.frontend.session_magics import live_session as _ls\n"
                "_wf = _ls().incarnation.watched_files\n_t0 = _t.perf_counter()\nfor _ in range(500):\n"
                "    _wf.changed()\n(len(_wf), (_t.perf_counter() - _t0) / 500)")
    assert res.status == "ok", res.error_text
    kernel_files, kernel_check = eval(res.result)
    on_off = {"on": [], "off": []}
    for i in range(repeat):
        for state in (("on", "off") if i % 2 == 0 else ("off", "on")):
            assert k.run(f"%dist_autoreload {state}").status == "ok"
            on_off[state].extend(_times(k, "%%distributed\nx = 1", 1))
    k.run("%dist_autoreload kernel")
    return {"watched": watched, "sys_modules": in_sys, "check": check, "scan": scan, "kernel_files": kernel_files,
            "kernel_check": kernel_check, **on_off}


def _print_autoreload(n: int, cost: dict) -> None:
    med, ms = statistics.median, 1e3
    on, off = cost["on"], cost["off"]
    paired = [a - b for a, b in zip(on, off)]
    print(f"  %autoreload, {cost['watched']} user modules watched of {cost['sys_modules']} in sys.modules, "
          f"rank 0 alone:")
    print(f"    the kernel's check before a cell, for the ranks on its machine ({cost['kernel_files']} files, "
          f"a stat each) {cost['kernel_check'] * 1e6:.1f} us")
    print(f"    a rank's own check (a rank on another machine; a stat each) {cost['check'] * 1e6:.1f} us")
    print(f"    scan of sys.modules after a cell that imported something {cost['scan'] * 1e6:.1f} us "
          f"(nothing imported: a len())")
    print(f"    session cell 'x = 1', {n} ranks, on / off  {med(on) * ms:7.1f} / {med(off) * ms:.1f} ms, paired "
          f"difference {med(paired) * ms:+.2f} ms (median of {len(paired)}; goal <= 1 ms)")


def _stop_figures(k, repeat: int, drift_stops: int = 0) -> dict:
    """The stop button, until the kernel answers (the ranks idle, their state kept): in a loop
    without collectives; while rank 1 waits in DDP's backward for rank 0, asleep in Python (the
    deadline stops rank 0 where it is, rank 1 is released, the group re-formed); with every rank
    stuck in a recv; and ``drift_stops`` times in a DDP training loop at random moments, counting
    the stops after which the replicas differ."""
    # The stop button on a busy cell: until the kernel answers, the ranks idle, their state kept.
    stops = _stop_times(k, "%%distributed --view text\nimport time\nwhile True:\n    time.sleep(0.001)",
                        "state kept", repeat)
    assert k.run("%%distributed --view text\nx").result == "1"

    # The stop button while rank 1 waits in DDP's backward for rank 0 (asleep in Python).
    res = k.run("%%distributed --view text\nimport pathlib\n"
                "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))\n"
                "def step():\n    model(torch.randn(32, 64)).sum().backward()")
    assert res.status == "ok", res.error_text
    stuck_stops, reforms = [], []
    for i in range(repeat):
        marker = f"/tmp/nbdist-bench-asleep-{os.getpid()}-{i}"
        msg = k.send(f"%%distributed --view text\nfor i in range(10**6):\n    if i == 5 and dist.get_rank() == 0:\n"
                     f"        pathlib.Path({marker!r}).touch()\n        time.sleep(600)\n    step()")
        while not os.path.exists(marker):
            time.sleep(0.01)
        time.sleep(0.2)
        t0 = time.monotonic()
        k.km.interrupt_kernel()
        res = k.collect(msg, timeout=30)
        assert res.status == "error" and "re-formed in place" in res.error_text, res.error_text
        stuck_stops.append(time.monotonic() - t0)
        reforms.append(float(res.error_text.split("re-formed in place in ")[1].split(" ms")[0]) / 1e3)
        os.remove(marker)
    raises = []
    for _ in range(repeat):
        res = k.run("%%distributed --view text\nif dist.get_rank() == 1:\n    time.sleep(0.3)\n"
                    "    raise ValueError('bad shard')\ndist.barrier()")
        assert res.status == "error" and "re-formed in place" in res.error_text, res.error_text
        raises.append(res.seconds - 0.3)
    # The stop button with every rank stuck (each in a recv from the next): no rank is free to
    # release the others, so each cuts its own connections.
    all_stuck = _stop_times(k, "%%distributed --view text\nr = torch.zeros(1)\n"
                               "dist.recv(r, src=(dist.get_rank() + 1) % dist.get_world_size())",
                            "each cutting its own connections", 3)
    out = dict(stops=stops, stuck_stops=stuck_stops, reforms=reforms, raises=raises, all_stuck=all_stuck)
    if drift_stops:
        out.update(_drift_figures(k, drift_stops))
    return out


def _drift_figures(k, count: int) -> dict:
    """Stop a 4-layer DDP loop with Adam ``count`` times after a seeded random delay; after each,
    compare the ranks' parameters and Adam step counts. Returns the stop times and the drifts."""
    res = k.run("%%distributed --view text\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
                "torch.manual_seed(0)\nnet = DDP(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]))\n"
                "adam = torch.optim.Adam(net.parameters())\nxs = torch.randn(32, 64)\n"
                "def train():\n    adam.zero_grad()\n    net(xs).sum().backward()\n    adam.step()\n"
                "def fingerprint():\n    with torch.no_grad():\n"
                "        return (sum(p.double().sum() for p in net.parameters()).item(),\n"
                "                sum(float(s['step']) for s in adam.state.values()))\ntrain()")
    assert res.status == "ok", res.error_text
    rng, took, drifts = random.Random(0), [], 0
    for _ in range(count):
        msg = k.send("%%distributed --view text\nwhile True:\n    train()")
        time.sleep(rng.uniform(0.05, 1.2))
        t0 = time.monotonic()
        k.km.interrupt_kernel()
        k.collect(msg, timeout=30)
        took.append(time.monotonic() - t0)
        prints = k.run("from nbdist.frontend.session_magics import live_session as _ls\n"
                       "len(set(_ls().execute('fingerprint()').values()))")
        drifts += prints.result != "1"
        if prints.result != "1":  # in step again for the next stop: rank 0's parameters, a fresh Adam
            k.run("_ls().execute('for p in net.parameters():\\n    dist.broadcast(p.data, src=0)\\n"
                  "adam = torch.optim.Adam(net.parameters())\\ntrain()')")
    return {"train_stops": took, "drifts": drifts, "drift_stops": count}


def _print_stops(n: int, f: dict) -> None:
    med, ms = statistics.median, 1e3
    print(f"  stop button -> ranks idle, state kept       {med(f['stops']) * ms:7.1f} ms (a loop without collectives; "
          f"median of {len(f['stops'])})")
    print(f"  stop button, a rank stuck in DDP backward   {med(f['stuck_stops']) * ms:7.1f} ms to idle, of which "
          f"re-forming the group {med(f['reforms']) * ms:.1f} ms (median of {len(f['stuck_stops'])})")
    print(f"  stop button, every rank stuck in a recv     {med(f['all_stuck']) * ms:7.1f} ms to idle (each cut its own "
          f"connections; median of {len(f['all_stuck'])})")
    print(f"  a rank raises, its peers in a collective    {med(f['raises']) * ms:7.1f} ms to the error, group re-formed "
          f"(goal <= 2000 ms)")
    if "drifts" in f:
        print(f"  stop button in a DDP+Adam training loop     {med(f['train_stops']) * ms:7.1f} ms to idle (max "
              f"{max(f['train_stops']) * ms:.0f}); replicas apart after {f['drifts']} of {f['drift_stops']} stops "
              f"(goal 0)")


def main() -> None:
    import psutil
    from kernel_client import Kernel

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--autoreload-only", action="store_true", help="only what %%autoreload costs a session cell")
    parser.add_argument("--stops-only", action="store_true", help="only the stop button's figures")
    parser.add_argument("--drift-stops", type=int, default=20, help="stops of a DDP training loop, for drift")
    args = parser.parse_args()
    n, r, med = args.nprocs, args.repeat, statistics.median
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.stops_only:
        k = Kernel(env=env)
        try:
            assert k.run("%load_ext nbdist").status == "ok"
            k.run("import nbdist.warmstart.handle\nnbdist.warmstart.handle.current_template().wait_ready(120)")
            assert k.run(f"%dist_start -n {n}").status == "ok"
            k.run("from nbdist.frontend.session_magics import live_session\nlive_session().wait_ready(120)")
            assert k.run("%%distributed --view text\nimport torch, torch.distributed as dist\nx = 1").status == "ok"
            stop = _stop_figures(k, 5, args.drift_stops)
            k.run("%dist_stop")
        finally:
            k.shutdown()
        print(f"{n} ranks, the stop button through a real kernel")
        _print_stops(n, stop)
        return
    if args.autoreload_only:
        k = Kernel(env=env)
        try:
            assert k.run("%load_ext nbdist").status == "ok"
            k.run("import nbdist.warmstart.handle\nnbdist.warmstart.handle.current_template().wait_ready(120)")
            assert k.run(f"%dist_start -n {n}").status == "ok"
            k.run("from nbdist.frontend.session_magics import live_session\nlive_session().wait_ready(120)")
            cost = _autoreload_cost(k, n, r)
            k.run("%dist_stop")
        finally:
            k.shutdown()
        _print_autoreload(n, cost)
        return
    k, kp = Kernel(env=env), Kernel(env=env)  # nbdist's kernel, ipyparallel's kernel
    try:
        assert k.run("%load_ext nbdist").status == "ok"
        k.run("import nbdist.warmstart.handle\nnbdist.warmstart.handle.current_template().wait_ready(120)")
        assert k.run(f"%dist_start -n {n}").status == "ok"
        k.run("from nbdist.frontend.session_magics import live_session\nlive_session().wait_ready(120)")
        setup = k.run("%%distributed --view text\nimport torch, torch.distributed as dist\nx = 0")
        assert setup.status == "ok", setup.error_text
        # ipyparallel's %px on n engines, in its own kernel, up for the whole comparison.
        res = kp.run(f"import ipyparallel as ipp\nrc = ipp.Cluster(n={n}, log_level=40).start_and_connect_sync()\n"
                     f"rc.wait_for_engines({n}, timeout=120)\nrc[:].activate()\n"
                     "rc[:].execute('import torch, torch.distributed', block=True)\nlen(rc)", timeout=300)
        assert res.status == "ok" and res.result == str(n), res.error_text
        trivial = "x = 1"
        reduce = "t = torch.ones(1)\ndist.all_reduce(t)"
        ours = {"plain": trivial, "session": f"%%distributed\n{trivial}",  # the default view: what users get
                "text": f"%%distributed --view text\n{trivial}", "reduce": f"%%distributed\n{reduce}"}
        theirs = {"plain_px": trivial, "px": f"%px {trivial}", "px_local": "%px t = torch.ones(1); t.add_(1)"}
        times = {name: [] for name in (*ours, *theirs)}
        block = 6  # rounds per block, the first a warm-up
        for b in range(-(-r // (block - 1))):
            for kernel, cells in ((k, ours), (kp, theirs)) if b % 2 == 0 else ((kp, theirs), (k, ours)):
                _rounds(kernel, cells, times, b * block, block)
        kp.run("rc.cluster.stop_cluster_sync()", timeout=120)
        plain, plain_px, sess_trivial, text_trivial = times["plain"], times["plain_px"], times["session"], times["text"]
        sess_reduce, px_trivial, px_local = times["reduce"], times["px"], times["px_local"]
        over = [s - p for s, p in zip(sess_trivial, plain)]  # paired, round by round

        stop = _stop_figures(k, 5, args.drift_stops)
        # The forwarding: one small all_reduce through the session's group and through its inner group.
        res = k.run("%%distributed --view text\nimport time as _t\ng = dist.distributed_c10d._get_default_group()\n"
                    "def per_call(fn, n=2000):\n    dist.barrier()\n    t0 = _t.perf_counter()\n"
                    "    for _ in range(n):\n        fn()\n    return (_t.perf_counter() - t0) / n\n"
                    "u = torch.ones(16)\nouter = per_call(lambda: dist.all_reduce(u))\n"
                    "inner = per_call(lambda: g._inner.allreduce([u]).wait())\n(outer, inner)")
        assert res.status == "ok", res.error_text
        outer, inner = eval(res.result)

        pids = [int(p) for p in k.run("list(live_session().pids.values())").result.strip("[]").split(",")]
        procs = [psutil.Process(p) for p in pids]
        time.sleep(1.0)
        before = [sum(p.cpu_times()[:2]) for p in procs]
        time.sleep(5.0)
        idle_cpu = sum(sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before))
        autoreload = _autoreload_cost(k, n, r)
        k.run("%dist_stop")

    finally:
        k.shutdown()
        kp.shutdown()

    ms = 1e3
    print(f"{n} ranks, medians of {len(plain)} rounds through real kernels (each round runs every cell once)")
    print(f"  plain 'x = 1' cell                          {med(plain) * ms:7.1f} ms")
    print(f"  session cell 'x = 1' (default view)         {med(sess_trivial) * ms:7.1f} ms"
          f"   +{med(over) * ms:5.1f} ms over the plain cell, paired by round (goal <= 5 ms)")
    print(f"  session cell 'x = 1', --view text           {med(text_trivial) * ms:7.1f} ms")
    print(f"  session cell, one all_reduce (default view) {med(sess_reduce) * ms:7.1f} ms")
    print(f"  plain 'x = 1' cell, ipyparallel's kernel    {med(plain_px) * ms:7.1f} ms")
    print(f"  ipyparallel %px 'x = 1' on {n} engines        {med(px_trivial) * ms:7.1f} ms"
          f"   session is {med(px_trivial) / med(sess_trivial):4.1f}x faster (goal >= 2x)")
    print(f"  ipyparallel %px, a local tensor op          {med(px_local) * ms:7.1f} ms")
    _print_stops(n, stop)
    print(f"  all_reduce of 16 floats, rank 0: {outer * 1e6:.1f} us through the session's group, "
          f"{inner * 1e6:.1f} us on its inner gloo group (forwarding +{(outer - inner) * 1e6:.1f} us)")
    print(f"  idle session: {idle_cpu:.3f} CPU-seconds over 5 s for {n} ranks")
    _print_autoreload(n, autoreload)


if __name__ == "__main__":
    main()
