"""Two nodes for real: two network namespaces, each with its own address and host name (nbdist treats
the other node's ranks as remote), a runs folder of its own per node, and a folder both see for the
cluster's shared file system (:class:`clusters.NetnsPair`). Skipped cleanly where namespaces can't be
made (not root), saying so.

- a 2-node torchrun session: cells, a stop, re-forming, a rank that dies, and a kernel SIGKILLed;
- a 2-node attach world (torchrun --nnodes 2): a stop in one kernel, then cells right on both;
- an mpirun world across both, with a stand-in for ssh that enters the other namespace.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import marked_pids, wait_for
from test_attach import STOP_THEN_CELLS, _check_stop_then_cells
from test_launchers import SESSION_NODE_SCRIPT, _free_port, _run_node_kernels, check_two_node_session

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pair():
    from clusters import NetnsPair, netns_missing

    why = netns_missing()
    if why:
        pytest.skip(f"two nodes need two network namespaces: {why}")
    made = NetnsPair.create(f"{os.getpid() % 1000}t")
    try:
        yield made
    finally:
        made.remove()


def _node_env(tmp_path, pair, k: int) -> dict:
    """Node ``k``'s environment: its own runs folder (node-local run dirs), one gloo interface name."""
    runs = tmp_path / f"node{k}-runs"
    runs.mkdir(mode=0o700, exist_ok=True)
    return dict(os.environ, NBDIST_RUN_DIR=str(runs), GLOO_SOCKET_IFNAME=pair.ifname, OMP_NUM_THREADS="1")


def test_a_two_node_torchrun_session_across_namespaces(pair, tmp_path):
    """The two-kernel session of test_launchers, each kernel on its own node: cells keep state across
    both, a raise and a stop re-form the world's groups on both kernels, a rank's death stops both."""
    script = tmp_path / "session_node.py"
    script.write_text(SESSION_NODE_SCRIPT.format())
    node0, node1 = _run_node_kernels(script, pair.addrs[0], prefix=lambda k: pair.command(k, []),
                                     extra=(str(tmp_path),), env=lambda k: _node_env(tmp_path, pair, k))
    check_two_node_session(node0, node1)
    # Each node's session lived in its own runs folder: nothing of one node's run dir is on the other's.
    assert os.listdir(tmp_path / "node0-runs") and os.listdir(tmp_path / "node1-runs")
    assert not set(os.listdir(tmp_path / "node0-runs")) & set(os.listdir(tmp_path / "node1-runs"))


KILLED_KERNEL_SCRIPT = """
import json, os, sys, time
import nbdist
node, flags = int(sys.argv[1]), sys.argv[4]
out = {}
with nbdist.Session(nprocs=2, launcher="torchrun", nnodes=2, node_rank=node, master_addr=sys.argv[2],
                    master_port=int(sys.argv[3])) as s:
    s.wait_ready(120)
    out["sum"] = s.execute("import torch, torch.distributed as dist\\nt = torch.ones(1)\\ndist.all_reduce(t)\\nt.item()",
                           timeout=100)
    with open(os.path.join(flags, f"sid{node}"), "w") as fh:
        fh.write(s.session_id)
    if node == 1:
        time.sleep(300)  # the test SIGKILLs this kernel
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(flags, "killed")) and time.monotonic() < deadline:
        time.sleep(0.02)
    # The dead kernel could not say so: the idle world finds out by itself, within seconds.
    t0 = time.monotonic()
    while s.status != "broken" and time.monotonic() - t0 < 40:
        time.sleep(0.05)
    out.update(status=s.status, lost=s.lost_reason, lost_s=time.monotonic() - t0)
    t0 = time.monotonic()
    try:
        s.execute("u = torch.ones(1)\\ndist.all_reduce(u)\\nu.item()", timeout=60)
        out["next"] = "ran"
    except Exception as e:
        out["next"] = type(e).__name__ + ": " + str(e).splitlines()[0]
    out.update(next_s=time.monotonic() - t0, sid=s.session_id)
    try:  # the dead ranks were on another node, under torchrun: no heal, said in one line
        s.heal()
        out["heal"] = "healed"
    except Exception as e:
        out["heal"] = type(e).__name__ + ": " + str(e)
print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_kernel_sigkilled_on_one_node_ends_its_tree_and_the_other_node_says_so(pair, tmp_path):
    script = tmp_path / "killed_kernel.py"
    script.write_text(KILLED_KERNEL_SCRIPT)
    port = str(_free_port())
    kernels = {k: subprocess.Popen(pair.command(k, [sys.executable, str(script), str(k), pair.addrs[0], port,
                                                    str(tmp_path)]),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=_node_env(tmp_path, pair, k)) for k in (1, 0)}
    try:
        try:
            wait_for(lambda: all((tmp_path / f"sid{k}").exists() for k in (0, 1)) or
                     any(p.poll() is not None for p in kernels.values()), 150, what="both sessions up")
        except AssertionError:
            for p in kernels.values():
                p.kill()
            pytest.fail("\n".join(p.communicate()[0][-3000:] for p in kernels.values()))
        if not all((tmp_path / f"sid{k}").exists() for k in (0, 1)):
            pytest.fail("a kernel ended early:\n" + "\n".join(p.communicate(timeout=60)[0][-3000:]
                                                             for p in kernels.values()))
        sid1 = (tmp_path / "sid1").read_text()
        assert marked_pids(sid1), "node 1's ranks and torchrun agent run"
        os.kill(kernels[1].pid, signal.SIGKILL)  # ip netns exec, unshare and sh all exec'd: this is the kernel
        kernels[1].wait(10)
        (tmp_path / "killed").touch()
        t0 = time.monotonic()
        wait_for(lambda: not marked_pids(sid1), 10, what="the killed kernel's agent and ranks to go")
        gone = time.monotonic() - t0
        out = kernels[0].communicate(timeout=120)[0]
    finally:
        for p in kernels.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    node0 = json.loads(out.split("RESULT ", 1)[1]) if "RESULT " in out else pytest.fail(out)
    print(f"node 1's kernel SIGKILLed: its tree gone in {gone:.2f} s; node 0's idle session {node0['status']} "
          f"{node0['lost_s']:.1f} s later: {node0['lost']}; its next cell: {node0['next']} in {node0['next_s']:.2f} s")
    assert node0["sum"] == {"0": 4.0, "1": 4.0}
    assert node0["status"] == "broken" and node0["lost_s"] < 25, node0
    assert "node 1's part of the world stopped answering" in node0["lost"], node0
    assert node0["next"].startswith("SessionLostError") and node0["next_s"] < 2, node0
    assert node0["heal"].startswith("RuntimeError: nbdist can't heal ranks that torchrun started"), node0
    assert "\n" not in node0["heal"] and "restart() brings new ranks" in node0["heal"], node0
    wait_for(lambda: not marked_pids(node0["sid"]), 10, what="node 0's session tree to go")


def test_a_two_node_attach_world_stays_in_step_after_a_stop(pair, tmp_path):
    """Two kernels attached to one torchrun world across the nodes (torchrun --nnodes 2, one agent per
    node): kernel 1's stop ends the round on kernel 0 too, the next three cells are right on both, and
    the kernels agreed a signing key through the shared folder."""
    script = tmp_path / "stop_then_cells.py"
    script.write_text(STOP_THEN_CELLS)
    port = str(_free_port())
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    agents = [subprocess.Popen(pair.command(k, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                                "--nproc-per-node", "1", "--node-rank", str(k), "--rdzv-backend",
                                                "c10d", "--rdzv-endpoint", f"{pair.addrs[0]}:{port}", "--local-addr",
                                                pair.addrs[k], str(script)]),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=dict(_node_env(tmp_path, pair, k), NBDIST_SHARED_DIR=str(shared)))
              for k in (0, 1)]
    outs = []
    try:
        for p in agents:
            outs.append(p.communicate(timeout=150)[0])
    finally:
        for p in agents:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "".join(outs)
    _check_stop_then_cells(text)
    assert not os.listdir(shared), "kernel 0 removed the key's file once both kernels had it"


RANK_ON_NODES = """
import json, sys
sys.path.insert(0, {here!r})
import nbdist, rankfns
run = nbdist.launch(rankfns.say_where_then_report, nprocs=4, launcher="mpirun", master_addr={addr!r},
                    launcher_args=["-launcher", "ssh", "-launcher-exec", {ssh!r}, "-hosts", {hosts!r}, "-ppn", "2"],
                    run_dir={shared!r}, timeout=90, join=False)
out = run.wait(timeout=120)
lines = {{r: [line for s, line in o.lines if s == "stdout"] for r, o in run.outputs.items()}}
print("RESULT " + json.dumps({{"values": out, "lines": lines, "via_channel": dict(run.channel.received),
                              "run_dir": run.run_dir}}), flush=True)
"""


def test_an_mpirun_world_across_both_nodes(pair, tmp_path):
    """mpiexec on node 0 starts two ranks there and two on node 1 through the ssh stand-in. The run dir
    is on the shared folder: ranks of both nodes register there (a file each, never an append), node
    1's ranks mirror their output to the kernel over the channel, and every rank gets the world's sum."""
    shared = tmp_path / "shared-runs"
    shared.mkdir(mode=0o700)
    script = tmp_path / "mpi_kernel.py"
    script.write_text(RANK_ON_NODES.format(here=HERE, addr=pair.addrs[0], ssh=pair.ssh_stand_in(str(tmp_path / "ssh")),
                                           hosts=",".join(pair.addrs), shared=str(shared)))
    proc = subprocess.run(pair.command(0, [sys.executable, str(script)]), capture_output=True, text=True, timeout=150,
                          env=_node_env(tmp_path, pair, 0))
    text = proc.stdout + proc.stderr
    result = json.loads(text.split("RESULT ", 1)[1].splitlines()[0]) if "RESULT " in text else pytest.fail(text)
    out = result["values"]
    assert {int(r): v["sum"] for r, v in out.items()} == {r: 10.0 for r in range(4)}, out
    assert {int(r): v["host"] for r, v in out.items()} == {0: pair.hosts[0], 1: pair.hosts[0],
                                                           2: pair.hosts[1], 3: pair.hosts[1]}, out
    run_dir = shared / os.path.basename(result["run_dir"])
    pids = {int(p.name.split(".")[0]): p.read_text().split() for p in (run_dir / "ranks").glob("*.pid")}
    assert {r: host for r, (_, host) in pids.items()} == {0: pair.hosts[0], 1: pair.hosts[0],
                                                          2: pair.hosts[1], 3: pair.hosts[1]}, pids
    assert not [p for p in run_dir.iterdir() if p.name in ("pids", "running")], "no shared append files"
    # Every rank's line reached the kernel once; node 1's came over the output channel too (live).
    for rank in range(4):
        host = pair.hosts[rank // 2]
        assert result["lines"][str(rank)].count(f"rank {rank} on {host} says hello") == 1, result["lines"]
    assert {int(r) for r, n in result["via_channel"].items() if n} == {2, 3}, result["via_channel"]
