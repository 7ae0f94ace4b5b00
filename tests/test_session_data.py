"""Data in and out of a session through shared memory: push, pull, scatter and gather of tensors,
arrays and other objects; each rank's copy its own; nothing left in /dev/shm or held open after a cell,
a kill or a kernel death."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from conftest import marked_pids, wait_for

import nbdist

pytestmark = pytest.mark.usefixtures("start_method")


@pytest.fixture
def session():
    s = nbdist.Session(nprocs=3)
    try:
        assert s.wait_ready(120)
        s.execute("import torch, numpy as np, os\nrank = int(os.environ['RANK'])")
        yield s
    finally:
        s.close()


def _memfds(pid: int) -> int:
    """How many of ``pid``'s descriptors are nbdist's shared values."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:nbdist-value")
        except OSError:
            pass
    return count


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_push_and_pull_tensors_arrays_and_objects(session):
    before = _shm()
    values = {"w": torch.randn(512, 256), "half": torch.ones(300, 300, dtype=torch.bfloat16),
              "cols": torch.arange(200 * 300).reshape(200, 300).t(), "arr": np.arange(50_000, dtype=np.float64),
              "cfg": {"lr": 0.1, "layers": [1, 2]}, "small": torch.ones(3)}
    session.push(**values)
    assert _memfds(os.getpid()) == 0, "the kernel let go of what it shared once the ranks had it"
    # Sums in float64: a float32 sum's rounding depends on its order (threads, vector width), and
    # randn's terms cancel to a small total, so a relative tolerance on it is not a check of the data.
    checks = session.execute("(w.double().sum().item(), half.dtype == torch.bfloat16, cols.is_contiguous(), cols.shape,"
                             " float(arr.sum()), cfg, small.tolist())")
    want = (values["w"].double().sum().item(), True, True, (300, 200), float(values["arr"].sum()), values["cfg"], [1.0, 1.0, 1.0])
    for got in checks.values():
        assert got[0] == pytest.approx(want[0]) and got[1:3] == want[1:3] and tuple(got[3]) == want[3], got
        assert got[4:] == want[4:], got
    # Each rank's copy is its own: a rank that writes into it changes nothing elsewhere.
    session.execute("w[0, 0] = 1000.0 + rank\narr[0] = -1 - rank")
    firsts = session.execute("(w[0, 0].item(), arr[0])")
    assert firsts == {r: (1000.0 + r, -1.0 - r) for r in range(3)} and values["w"][0, 0].item() < 100
    pulled = session.pull("w")
    assert all(torch.equal(pulled[r][1:], values["w"][1:]) and pulled[r][0, 0].item() == 1000.0 + r for r in range(3))
    pulled[0][0, 0] = 5.0  # the kernel's copy is its own too
    assert session.execute("w[0, 0].item()", ranks=[0]) == {0: 1000.0}
    assert session.pull("cfg") == {r: values["cfg"] for r in range(3)}
    session.execute("1")  # the ranks let go of the values they shared once the kernel had them
    assert all(_memfds(pid) == 0 for pid in session.pids.values())
    assert _shm() == before, "shared memory never goes through /dev/shm"


@pytest.mark.parametrize("kind", ["tensor", "array", "list"])
def test_scatter_and_gather(session, kind):
    data = {"tensor": torch.arange(20.0).reshape(10, 2), "array": np.arange(20).reshape(10, 2),
            "list": list(range(10))}[kind]
    session.scatter("piece", data)
    sizes = session.execute("len(piece)")
    assert sizes == {0: 4, 1: 3, 2: 3}, "as tensor_split and array_split split: the first pieces longer"
    session.execute("piece = piece * 2 if not isinstance(piece, list) else [x * 2 for x in piece]")
    back = session.gather("piece")
    if kind == "list":
        assert back == [x * 2 for x in data]
    else:
        assert (back == data * 2).all() and type(back) is type(data)
    if kind == "tensor":  # along another dim, and on some ranks only
        session.scatter("col", data, dim=1, ranks=[0, 2])
        assert session.execute("col.shape[1]", ranks=[0, 2]) == {0: 1, 2: 1}
        assert torch.equal(session.gather("col", dim=1, ranks=[0, 2]), data)


def test_a_big_push_and_pull_take_about_a_copy(session):
    """256 MB to three ranks and back: each way about one memory copy, not a pickle through a file."""
    big = torch.randn(64 * 2**20)  # 256 MB of float32
    t0 = time.perf_counter()
    session.push(big=big)
    pushed = time.perf_counter() - t0
    assert session.execute("big.numel()") == {r: big.numel() for r in range(3)}
    t0 = time.perf_counter()
    back = session.pull("big")
    pulled = time.perf_counter() - t0
    t0 = time.perf_counter()
    big.clone()
    copy = time.perf_counter() - t0
    assert all(torch.equal(b, big) for b in back.values())
    print(f"256 MB: push to 3 ranks {pushed:.2f} s, pull from 3 {pulled:.2f} s, one copy {copy:.2f} s")
    assert pushed < 10 * copy + 1.0 and pulled < 10 * copy + 1.0, (pushed, pulled, copy)


def test_nothing_shared_is_left_after_a_kill_or_the_kernel_s_death(run_script):
    """Shared values are anonymous memory held by processes: a rank killed mid-cell or a kernel
    SIGKILLed leaves nothing in /dev/shm, and the memory goes with the processes."""
    before = _shm()
    proc = run_script(
        """
        import torch, nbdist, time
        s = nbdist.Session(nprocs=2)
        s.wait_ready(120)
        s.push(big=torch.ones(16 * 2**20))
        s.execute("import time, torch\\nkept = big.sum().item()")
        s.pull("big")
        print("SESSION", s.session_id, s.pids[1], flush=True)
        cell = s.execute("time.sleep(60)", join=False)
        time.sleep(600)
        """
    )
    _, sid, rank1 = proc.stdout.readline().split()
    os.kill(int(rank1), signal.SIGKILL)  # a rank killed from outside, mid-cell
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGKILL)  # then the kernel
    proc.wait()
    wait_for(lambda: not marked_pids(sid), 5, what="the session to go with its kernel")
    assert _shm() == before


def test_a_value_handed_on_outlives_its_writer_without_a_copy():
    """What a heal does with the donor's state: the kernel reshares a rank's memfds (its own
    descriptors to the same memory), the writer lets go and exits, and a reader still maps the
    value: the writer's bytes, not a copy the kernel made."""
    import pickle
    import subprocess
    import sys

    from nbdist.protocol.shared_values import load_shared, reshare

    writer = ("import pickle, sys, numpy as np\n"
              "from nbdist.protocol.shared_values import dump_shared\n"
              "shared = dump_shared({'a': np.arange(2**20, dtype=np.float32)}, 'a test value')\n"
              "sys.stdout.buffer.write(pickle.dumps(shared)); sys.stdout.buffer.flush()\n"
              "sys.stdin.readline()\nshared.close()\n")
    proc = subprocess.Popen([sys.executable, "-c", writer], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        sent = pickle.load(proc.stdout)  # one pickle: no need to wait for the end of the stream
        assert sent.pid == proc.pid and len(sent.fds) == 1
        mine = reshare(sent)
        proc.communicate(b"done\n", timeout=30)
        assert proc.returncode == 0
        assert mine.pid == os.getpid() and mine.sizes == sent.sizes
        value = load_shared(mine)
        mine.close()  # the mapping keeps the memory; no descriptor is left open
        assert _memfds(os.getpid()) == 0
        assert np.array_equal(value["a"], np.arange(2**20, dtype=np.float32))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)
