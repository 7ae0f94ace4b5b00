"""A re-forming that a death calls off (nbdist.worker.member_arrival), in one process: the members'
wait is freed by the kernel's word, by another member giving up, or by a dead peer of this machine;
a peer that only shares the hostname (another PID namespace) is never judged from here. Through a
real kernel: tests/test_heal.py (a death while the heal re-forms)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from nbdist.protocol.session_channel import REFORM_CALLED_OFF_FILE
from nbdist.worker import member_arrival
from nbdist.worker.member_arrival import Reforming, ReformCalledOff, _dead_here, _where


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield dist.PrefixStore("default_pg/0/", dist.TCPStore("127.0.0.1", server.port, is_master=False))


@pytest.fixture
def session_dir(tmp_path):
    member_arrival.watch_calls_off(str(tmp_path))
    yield tmp_path
    member_arrival._SESSION_DIR.clear()


def _wait_as_rank_0(store, generation: int = 7) -> float:
    """Rank 0 of two re-forms; rank 1 never comes. Returns how long until it was called off."""
    reforming = Reforming(dist.PrefixStore(f"nbdist-gen{generation}/", store), 0, (0, 1), generation, "group g")
    t0 = time.monotonic()
    with pytest.raises(ReformCalledOff) as raised:
        with reforming.watched(store) as own:
            reforming.await_members(dist.PrefixStore(f"nbdist-gen{generation}/", own), time.monotonic() + 30)
    took = time.monotonic() - t0
    print(f"called off after {took:.2f} s: {raised.value}")
    return took, str(raised.value)


def test_the_kernels_word_frees_a_member_waiting_for_a_peer(store, session_dir):
    path = session_dir / REFORM_CALLED_OFF_FILE.format(generation=7)
    threading.Timer(0.3, lambda: path.write_text("rank 1 was killed by SIGKILL (pid 4)")).start()
    took, said = _wait_as_rank_0(store)
    assert took < 2 and "re-forming group g was called off: rank 1 was killed by SIGKILL" in said
    gen = dist.PrefixStore("nbdist-gen7/", store)
    assert gen.get("gave-up") == b"rank 1 was killed by SIGKILL (pid 4)"  # for the others


def test_a_member_that_gave_up_frees_the_others(store, session_dir):
    gen = dist.PrefixStore("nbdist-gen7/", store)  # as the other member's own Reforming says it
    threading.Timer(0.3, lambda: gen.set("gave-up", "rank 1 (pid 5) died")).start()
    took, said = _wait_as_rank_0(store)
    assert took < 2 and said.endswith("called off: rank 1 (pid 5) died"), said


def test_a_member_that_never_comes_is_named_at_the_deadline(store, session_dir):
    reforming = Reforming(dist.PrefixStore("nbdist-gen3/", store), 0, (4, 9), 3, "group g")
    with pytest.raises(ReformCalledOff, match="rank 9 never came to it"):
        with reforming.watched(store) as own:
            reforming.await_members(dist.PrefixStore("nbdist-gen3/", own), time.monotonic() - 1)  # floor: 5 s


def test_a_dead_peer_counts_only_where_its_pid_can_be_looked_up():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)  # reaped: its pid names no process now
    here, mine = _where(), f"{os.getpid()}@{_where()}".encode()
    assert _dead_here((0, 3), [mine, f"{child.pid}@{here}".encode()]) == f"rank 3 (pid {child.pid}) died"
    host, boot, _ = here.split("|")
    elsewhere = f"{child.pid}@{host}|{boot}|1".encode()  # same host and boot, another PID namespace
    assert _dead_here((0, 3), [mine, elsewhere]) is None
    assert _dead_here((0, 3), [mine, f"{os.getppid()}@{here}".encode()]) is None  # alive


def test_a_member_still_stuck_after_the_give_up_says_where_in_its_log(store, session_dir, monkeypatch, capfd):
    # A CI run saw rank 0 stay in gloo's connect after its watcher gave up: the log now says what
    # the stuck thread waits in (its system call, its sockets' states), for the next one to read.
    monkeypatch.setattr(member_arrival, "_STILL_STUCK_S", 0.3)
    reforming = Reforming(dist.PrefixStore("nbdist-gen7/", store), 0, (0, 1), 7, "group g")
    path = session_dir / REFORM_CALLED_OFF_FILE.format(generation=7)
    threading.Timer(0.2, lambda: path.write_text("rank 1 was killed by SIGKILL (pid 4)")).start()
    with pytest.raises(ReformCalledOff, match="called off: rank 1 was killed"):
        with reforming.watched(store):
            time.sleep(1.5)  # a wait in C that no socket of ours frees
    err = capfd.readouterr().err
    assert "re-forming group g (generation 7) given up: rank 1 was killed by SIGKILL (pid 4)" in err, err
    stuck = next(line for line in err.splitlines() if "still re-forming" in line)
    assert "syscall " in stuck and "TCP sockets: " in stuck and "ESTABLISHED" in stuck, stuck
