"""The store host: a loopback session's kernel never imports torch, the store outlives a failing rank,
and the host dies with its kernel. Through real IPython kernels (jupyter_client), and in this process."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from conftest import gone, kernel_store_host, nbdist_kernel, wait_for
from kernel_client import Kernel

ALL_REDUCE = ("%%distributed --view text\nimport torch, torch.distributed as dist\n"
              "t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)")


def _has_torch(kernel) -> str:
    return kernel.run("import sys\n'torch' in sys.modules").result


def test_a_loopback_session_keeps_torch_out_of_the_kernel_and_its_store_outlives_a_raising_rank():
    plain = Kernel(env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        assert plain.run("import sys, os").status == "ok"
        with nbdist_kernel("warm") as k:
            host = kernel_store_host(k)
            assert host is not None
            listed = k.run("from nbdist.frontend.cli import format_table\nfrom nbdist.run.processes import find_marked\n"
                           "print(format_table(find_marked()))").stdout
            assert f"store host pid {host} (this process's" in listed, listed
            assert k.run("%dist_start -n 2").status == "ok"
            res = k.run(ALL_REDUCE)
            assert res.status == "ok" and res.result == "2.0", res.error_text + res.stdout
            assert _has_torch(k) == "False"
            grew = (psutil.Process(k.pid).memory_info().rss - psutil.Process(plain.pid).memory_info().rss) / 2**20
            print(f"a 2-rank session's kernel: {grew:+.0f} MiB over a plain kernel's RSS")
            assert grew < 60, f"the session's kernel is {grew:.0f} MiB over a plain kernel's"
            # Rank 0 raises in a collective's stead: the ranks re-form at the same store, which
            # lives in the store host, not in rank 0 nor in the kernel.
            res = k.run("%%distributed --view text\nif dist.get_rank() == 0:\n    raise ValueError('boom')\n"
                        "dist.all_reduce(t)")
            assert res.status == "error" and "ValueError" in res.error_text, res.error_text
            res = k.run(ALL_REDUCE)
            assert res.status == "ok" and res.result == "2.0", res.error_text + res.stdout
            assert _has_torch(k) == "False"
            assert "stopped (2 ranks)" in k.run("%dist_stop").stdout
            # `%dist_start` without -n counts the GPUs: the store host counted them.
            assert int(k.run("import nbdist\nnbdist.default_nprocs()").result) >= 1
            assert _has_torch(k) == "False"
    finally:
        plain.shutdown()


def test_the_store_host_dies_with_its_kernel():
    with nbdist_kernel("spawn") as k:
        host = kernel_store_host(k)
        assert host is not None and psutil.pid_exists(host)
        assert k.run("import nbdist.launchers.store_host as _sh\n_sh.current_store_host().wait_ready(60)").result == "True"
        os.kill(k.pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: gone(host), 3, what="the store host to die with its kernel")
        print(f"kernel SIGKILL -> store host gone in {time.monotonic() - t0:.2f} s")


def test_a_store_host_that_died_hands_the_store_to_this_process_and_a_new_host_starts(capsys):
    pytest.importorskip("torch")
    import torch.distributed as dist

    from nbdist.launchers import store_host
    from nbdist.launchers.rendezvous import open_rendezvous

    first = store_host.start_store_host()
    try:
        assert first.wait_ready(60), first.describe()
        rdzv = open_rendezvous("auto", 2)
        assert rdzv.store is None and rdzv.release is not None  # hosted there, not here
        client = dist.TCPStore("127.0.0.1", rdzv.master_port, is_master=False,
                               timeout=__import__("datetime").timedelta(seconds=5))
        client.set("k", "v")
        assert client.get("k") == b"v"
        rdzv.close()
        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait(5)
        rdzv = open_rendezvous("auto", 2)  # torch is here: this process hosts it while a new host starts
        assert rdzv.store is not None and rdzv.release is None
        rdzv.close()
        assert "a new store host is starting" in capsys.readouterr().err
        second = store_host.current_store_host()
        assert second is not first and second.wait_ready(60), second.describe()
    finally:
        store_host.close_store_hosts()


def test_the_cuda_watch_starts_at_the_users_own_import_of_torch(run_script):
    """The kernel no longer imports torch at load, so the watch waits for the user's ``import torch``:
    a cell that imports torch and calls ``.cuda()`` at once is still named. No GPU here: CUDA's own
    init fails on this CPU build after the watch saw the call."""
    proc = run_script("""
        import sys
        from nbdist.launchers.cuda_watch import watch_cuda_init_when_imported, who_initialised_cuda
        watch_cuda_init_when_imported()
        assert "torch" not in sys.modules
        import torch
        assert sys.meta_path[0].__class__.__name__ != "_WatchOnImport"
        try:
            torch.cuda._lazy_init()  # FIRST CUDA USE, as .cuda() would call it
        except Exception:
            pass
        print("WHERE", who_initialised_cuda())
        print("LOADER", type(torch.__spec__.loader).__name__, "exec_module" in vars(torch.__spec__.loader))
    """)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "WHERE " in out and "# FIRST CUDA USE" in out, out
    assert "LOADER SourceFileLoader False" in out, out
