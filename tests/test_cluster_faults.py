"""The cluster fault matrix, on one machine: what a run and a session must survive once ranks live
on other hosts, share a run dir over a network file system, or face strangers on the network.

Each test names the defect it guards against; the same faults across two network namespaces are
in ``test_two_nodes.py``.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import socket
import sys
import textwrap
import time
from collections import defaultdict

import pytest
import rankfns
from conftest import wait_for

import nbdist
from nbdist.protocol.output_mirror import HEADER
from nbdist.protocol.registration import read_rank_pids, read_running
from nbdist.protocol.signing import dumps_signed
from nbdist.run.output_channel import OutputChannel, new_channel_key
from nbdist.worker.kernel_connect import KernelUnreachable, connect_to_kernel

# Records every open with O_APPEND that a rank process makes, into a file of its own per process
# (the audit must not share appends either). Loaded by the ranks through PYTHONPATH.
_APPEND_AUDIT = textwrap.dedent("""
    import os, sys
    _dir, _fd = os.environ.get("NBDIST_TEST_APPEND_AUDIT"), []
    def _audit(event, args):
        if event != "open" or len(args) < 3 or not isinstance(args[2], int) or not args[2] & os.O_APPEND:
            return
        if isinstance(args[0], (str, bytes, os.PathLike)):
            if not _fd:  # opened without O_APPEND, so the hook does not see itself
                _fd.append(os.open(os.path.join(_dir, str(os.getpid())), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            os.write(_fd[0], (os.path.abspath(os.fsdecode(args[0])) + "\\n").encode())
    if _dir:
        sys.addaudithook(_audit)
""")


def test_ranks_register_under_load_without_shared_appends(tmp_path):
    """Registration on NFS: ranks once appended "rank pid host" lines to one shared ``pids`` file
    (and "rank" lines to ``running``) with O_APPEND, which NFS does not make atomic; a lost line
    left a slot "still starting" and marked a good run failed. Now each rank writes files of its
    own, atomically. 16 ranks start at once on 2 cores; an audit hook in every rank records each
    O_APPEND open, and no file of the run dir may be appended to by two processes."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_APPEND_AUDIT)
    audit = tmp_path / "audit"
    audit.mkdir()
    runs = tmp_path / "runs"
    env = {"PYTHONPATH": os.pathsep.join([str(site)] + [p for p in sys.path if p]),
           "NBDIST_TEST_APPEND_AUDIT": str(audit)}
    run = nbdist.launch(rankfns.rank_and_pid, nprocs=16, init_process_group=False, start_method="spawn",
                        env=env, run_dir=str(runs), join=False)
    out = run.wait(timeout=150)
    assert sorted(out) == list(range(16))
    registered = read_rank_pids(run.run_dir)
    assert {r: w.pid for r, w in registered.items()} == {r: pid for r, (_, pid) in out.items()}
    assert read_running(run.run_dir) == set(range(16)), "every rank said it reached the user's code"

    writers = defaultdict(set)
    for name in os.listdir(audit):
        for path in (audit / name).read_text().split():
            if path.startswith(run.run_dir + os.sep):
                writers[path].add(int(name))
    assert len(os.listdir(audit)) >= 16, "the audit hook ran in every rank"
    shared = {os.path.relpath(p, run.run_dir): sorted(pids) for p, pids in writers.items() if len(pids) > 1}
    assert not shared, f"files of the run dir appended to by several processes: {shared}"


def _silent_and_garbage(address, silent: int = 3):
    """Connections a stranger on the cluster's network could make: some that say nothing, one
    that sends garbage. Returned open (the caller closes them)."""
    socks = [socket.create_connection(tuple(address), timeout=5) for _ in range(silent)]
    garbage = socket.create_connection(tuple(address), timeout=5)
    garbage.sendall(os.urandom(512))
    return socks + [garbage]


def test_silent_and_garbage_connections_to_a_runs_output_channel_block_no_rank():
    """A run's output channel was the standard library's Listener: backlog 1, the HMAC handshake in
    its one accept thread, no deadline. One silent connection to the port blocked every rank behind it."""
    key = new_channel_key()
    channel = OutputChannel("127.0.0.1", key, nprocs=4)
    strangers = _silent_and_garbage(channel.address)
    try:
        t0 = time.monotonic()
        conns = [connect_to_kernel(channel.address, bytes.fromhex(key), rank, timeout=10) for rank in range(4)]
        took = time.monotonic() - t0
        for rank, conn in enumerate(conns):
            conn.send_bytes(HEADER.pack(rank, 0, 0) + f"line of rank {rank}\n".encode())
        wait_for(lambda: all(channel._pieces.get(r) for r in range(4)), 5, what="every rank's piece")
        assert [channel.take(r) for r in range(4)] == [[("stdout", 0, f"line of rank {r}\n".encode())] for r in range(4)]
        print(f"4 ranks in through 3 silent connections and a garbage one: {took * 1e3:.0f} ms")
        assert took < 3.0
        wait_for(lambda: channel.refused >= 1, 5, what="the garbage connection to be refused")
        with pytest.raises(KernelUnreachable, match="refused"):  # and a rank with the wrong key gets a clear line
            connect_to_kernel(channel.address, b"not the key", 9, timeout=5)
        for conn in conns:
            conn.close()
    finally:
        for s in strangers:
            s.close()
        channel.close()


def test_a_ranks_connect_to_a_kernel_that_never_answers_ends_at_its_deadline():
    """The rank's Client() had no deadline either: a listener that accepts and stays silent held it."""
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)  # the kernel's queue takes the connection; nobody ever answers the challenge
    try:
        t0 = time.monotonic()
        with pytest.raises(KernelUnreachable, match="did not finish its handshake in time"):
            connect_to_kernel(mute.getsockname(), b"k" * 32, 3, timeout=1.5)
        assert time.monotonic() - t0 < 4.0
    finally:
        mute.close()


def test_silent_and_garbage_connections_to_a_sessions_channel_block_no_rank():
    s = nbdist.Session(nprocs=2)
    try:
        strangers = _silent_and_garbage(s.address)
        try:
            t0 = time.monotonic()
            assert s.wait_ready(120)
            print(f"a 2-rank session ready {time.monotonic() - t0:.1f} s after 3 silent connections and a garbage one")
            assert s.execute("1 + 1") == {0: 2, 1: 2}
            assert s.incarnation.listener.refused >= 1
        finally:
            for sock in strangers:
                sock.close()
    finally:
        s.close()


class _Planted:
    """A pickle that, once loaded, leaves a file: proof that something was unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_a_store_key_written_by_an_outsider_is_refused_named_and_never_unpickled(tmp_path):
    """Attached kernels under torchrun or Slurm exchanged pickle.loads(store.get(...)) over a TCPStore
    anyone who reaches it can write to: code execution in every kernel of the world."""
    import datetime

    import torch.distributed as dist

    from nbdist.launchers.kernel_comm import StoreComm
    from nbdist.protocol.signing import UnsignedMessageError, new_world_key

    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    key = new_world_key()
    kernel0 = StoreComm(server, 0, 2, key, timeout=10)
    outsider = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    planted = tmp_path / "unpickled"
    # The outsider writes kernel 1's answer for round 1 before kernel 1 does: a plain pickle, and one
    # signed with a key of its own.
    outsider.set("nbdist/attach/1/gather/1", pickle.dumps(_Planted(planted)))
    with pytest.raises(UnsignedMessageError, match="attach/1 claiming to come from rank 1") as info:
        kernel0.allgather("mine", "attach/1")
    print(f"refused: {info.value}")
    outsider.set("nbdist/attach/2/gather/1", dumps_signed(new_world_key(), _Planted(planted), topic="attach/2", sender=1))
    with pytest.raises(UnsignedMessageError, match="signature does not match"):
        kernel0.allgather("mine", "attach/2")
    # A stop posted by the outsider is not obeyed either, and is named.
    outsider.set("nbdist/attach/3/stop/1", pickle.dumps(_Planted(planted)))
    # TCPStore's set() returns before the server has it (no reply is read): a round trip on the same
    # connection does, else the check below may look first (CI, once).
    assert outsider.check(["nbdist/attach/3/stop/1"])
    assert kernel0.stop_posted("attach/3") is None and kernel0.refused == ["nbdist/attach/3/stop/1"]
    assert not planted.exists(), "nothing of the outsider's bytes was unpickled"
    # The real kernel 1, with the world's key, is heard.
    kernel1 = StoreComm(outsider, 1, 2, key, timeout=10)
    kernel1.store.set("nbdist/attach/4/gather/1", dumps_signed(key, "theirs", topic="attach/4", sender=1))
    assert kernel0.allgather("mine", "attach/4") == ["mine", "theirs"]
