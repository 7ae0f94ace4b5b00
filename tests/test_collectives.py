"""Which collective each session rank is in: the flight recorder, and ``--check-collectives``.

Real gloo ranks through ``nbdist.Session`` (spawned and forked from the warm template), and the
magics through a real kernel. The leak fixture checks that nothing outlives a test.
"""

from __future__ import annotations

import time

import pytest
from conftest import nbdist_kernel, wait_for

import nbdist
from nbdist.errors import RunStoppedError, WorkerFailedError

SETUP = "import time, torch, torch.distributed as dist\nrank = dist.get_rank()\n"
# Rank 0 all-reduces while rank 1 broadcasts from itself: a mismatch that hangs without a check.
MISMATCH = ("if rank == 0:\n    dist.all_reduce(torch.ones(3))\n"
            "else:\n    dist.broadcast(torch.ones(3), src=1)\n    dist.all_reduce(torch.ones(5))\n")


@pytest.fixture
def session(start_method):
    s = nbdist.Session(nprocs=2)
    try:
        assert s.wait_ready(120)
        s.execute(SETUP)
        yield s
    finally:
        s.close()


def _sum_all_reduce(session) -> dict:
    return session.execute("x = torch.ones(4)\ndist.all_reduce(x)\nfloat(x.sum())")


def test_the_recorder_keeps_each_rank_s_last_collectives(session):
    session.execute("dist.all_reduce(torch.ones(2, 3))\ndist.broadcast(torch.zeros(7, dtype=torch.int64), src=1)\n"
                    "dist.barrier()")
    kept = session.execute("from nbdist.worker.flight_recorder import recent_collectives\n"
                           "[(c.op, c.seq, c.tensors, c.root, c.state) for c in recent_collectives()]")
    for rank in (0, 1):
        assert kept[rank][-3:] == [("all_reduce", 1, ["float32[2, 3]"], None, "done"),
                                   ("broadcast", 2, ["int64[7]"], 1, "done"),
                                   ("barrier", 3, [], None, "done")], kept[rank]


def test_a_stopped_hang_says_which_collective_each_rank_is_in(session):
    cell = session.execute(MISMATCH, join=False)
    wait_for(lambda: all(r["open"] for r in session.collectives().values()) and len(session.collectives()) == 2,
             30, interval=0.2, what="both ranks to wait in their collectives")
    session.interrupt()
    with pytest.raises(RunStoppedError) as caught:
        cell.wait(30)
    text = str(caught.value)
    assert "rank 0: all_reduce #1 float32[3] on the default group, waiting" in text, text
    assert "rank 1: broadcast #1 float32[3] from rank 1 on the default group, waiting" in text, text
    assert "the ranks called different collectives" in text, text
    assert "torch's NCCL flight recorder" not in text, "gloo: torch's recorder has nothing to add"
    assert _sum_all_reduce(session) == {0: 8.0, 1: 8.0}, "idle, in step, usable"


def test_torch_s_own_flight_recorder_is_read_and_described(session):
    """torch records every collective in C++ too (its Flight Recorder, on by default). The reader
    takes NCCL's entries only (gloo's stay "scheduled" whatever happens), so on gloo it is asked
    for gloo's here: the real dump, parsed and described as the NCCL ones are (tests/test_gpu.py
    reads NCCL's on a GPU)."""
    said = session.execute(
        "from nbdist.worker import torch_flight_recorder as tfr\n"
        "dist.all_reduce(torch.ones(5, 2))\n"
        "entries = tfr.read_nccl_entries(only_active=False, backend='gloo')\n"
        "(tfr.nccl_in_use(), tfr.read_nccl_entries(), tfr.describe_torch_entry(entries[-1]))")
    for rank in (0, 1):
        in_use, nccl, text = said[rank]
        assert not in_use and nccl == [], said
        assert text.startswith("gloo:all_reduce #") and " float32[5, 2] on pg " in text, text


def test_check_collectives_turns_a_mismatch_into_an_error_that_names_each_call(session):
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError) as caught:
        session.execute("dist.all_reduce(torch.ones(4 + rank))", check_collectives=True)
    took = time.monotonic() - t0
    text = str(caught.value)
    assert "CollectiveMismatchError" in text and "rank 0: all_reduce float32[4]; rank 1: all_reduce float32[5]" in text
    assert took < 5, f"{took:.1f} s: the mismatch is an error at once, not a hang"
    with pytest.raises(WorkerFailedError, match="rank 0: all_reduce float32\\[3\\]; rank 1: broadcast float32\\[3\\]"):
        session.execute(MISMATCH, check_collectives=True)
    assert session.status == "idle"
    assert _sum_all_reduce(session) == {0: 8.0, 1: 8.0}, "no rank issued it: the groups are in step"


def test_checked_ddp_training_has_no_false_alarm(session):
    session.execute("from torch.nn.parallel import DistributedDataParallel as DDP\ntorch.manual_seed(0)\n"
                    "model = DDP(torch.nn.Linear(8, 1))\nopt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
                    "X = torch.randn(32, 8, generator=torch.Generator().manual_seed(rank))\n"
                    "dist.send(torch.ones(1), 1) if rank == 0 else dist.recv(torch.ones(1), 0)\n",
                    check_collectives=True)
    losses = session.execute("out = []\nfor _ in range(5):\n    opt.zero_grad()\n"
                             "    loss = (model(X) ** 2).mean()\n    loss.backward()\n    opt.step()\n"
                             "    out.append(loss.item())\nout", check_collectives=True)
    assert all(v[-1] < v[0] for v in losses.values()), losses


def test_the_magics_check_and_show_collectives(tmp_path):
    with nbdist_kernel("spawn") as k:
        res = k.run("%%distributed -n 2 --check-collectives\nprint(1)")
        assert res.status == "error" and "--check-collectives is for a session's cells" in res.error_text
        assert k.run("%dist_start -n 2 --check-collectives").status == "ok"
        res = k.run("%%distributed --view text\n" + SETUP + "dist.all_reduce(torch.ones(2 + rank))")
        assert res.status == "error", res.stdout
        assert "rank 0: all_reduce float32[2]; rank 1: all_reduce float32[3]" in res.error_text, res.error_text
        assert k.run("%dist_stop").status == "ok"
        # Unchecked (a checked cell waits for its peers in Python: the stop takes it at once).
        assert k.run("%dist_start -n 2").status == "ok"
        assert k.run("%%distributed --view text\n" + SETUP).status == "ok"
        # Rank 0 says when it is about to enter its barrier (a fixed sleep was lost to a busy box).
        hang = ("%%distributed --view text{}\nif rank == 0:\n    open({!r}, 'w').close()\n    dist.barrier()\n"
                "else:\n    time.sleep(60)")
        assert k.run(hang.format(" --bg", str(tmp_path / "bg"))).status == "ok"
        wait_for(lambda: (tmp_path / "bg").exists(), 30, what="rank 0 at its barrier")
        shown = []

        def stacks_show_the_barrier():
            shown.append(k.run("%dist_stacks").stdout)
            return "barrier #1 on the default group, waiting" in shown[-1]

        wait_for(stacks_show_the_barrier, 30, interval=0.3, what="%dist_stacks to show rank 0 in its barrier")
        assert "collective: barrier #1 on the default group, waiting" in shown[-1], shown[-1]
        assert "collective: none open" in shown[-1], shown[-1]
        assert k.run("_dist.interrupt()").status == "ok"
        msg = k.send(hang.format("", str(tmp_path / "fg")))  # the same hang, and the stop button
        wait_for(lambda: (tmp_path / "fg").exists(), 30, what="rank 0 at its barrier")
        time.sleep(0.5)  # into the barrier's wait from the file's line
        k.km.interrupt_kernel()
        res = k.collect(msg, timeout=30)
        said = res.stdout + res.error_text
        assert res.status == "error" and "where each rank waited: rank 0: barrier #1 on the default group, waiting" in said, said
        assert k.run("%%distributed --view text\nx = torch.ones(2)\ndist.all_reduce(x)\nfloat(x.sum())").result == "4.0"
        assert k.run("%dist_stop").status == "ok"


def test_the_words_for_nccl_ranks_add_what_torch_s_recorder_says_of_the_gpu():
    """NCCL's Python call returns once the collective is queued, so a rank's own recorder may have
    nothing open while the GPU still waits: torch's recorder says so (its entries come from a
    real NCCL dump in tests/test_gpu.py; here the kernel's words for them)."""
    from nbdist.session.collectives import describe_open_collectives

    gpu = "nccl:all_reduce #2 float32[1024] on pg 0 (default_pg), scheduled on the GPU 1.0 s ago"
    ours = "all_reduce #2 float32[1024] on the default group, waiting 1.0 s"
    text = describe_open_collectives({
        0: {"open": [ours], "fingerprints": ["a"], "torch": [gpu]},
        1: {"open": [], "fingerprints": [], "torch": [gpu]},
        2: {"open": [], "fingerprints": [], "torch": []}})
    assert text == (f"rank 0: {ours} (on the GPU, per torch's NCCL flight recorder: {gpu}); "
                    f"rank 1: on the GPU, {gpu} (torch's NCCL flight recorder); "
                    "rank 2: in no collective: rank 2 never joined"), text
