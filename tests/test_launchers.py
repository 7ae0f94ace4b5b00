"""Engines that start the ranks themselves: real mpiexec (pip's mpich), torchrun and srun (a real
Slurm on loopback), each with the same results, fail-fast and teardown as spawn."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import rankfns
from conftest import began, marked_pids, start_parent_with_loader_ranks, wait_began, wait_for

import nbdist
from nbdist.launchers.mpirun import MpirunLauncher
from nbdist.options import WorldOptions
from nbdist.run.start import start_run

MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed (pip install mpi4py mpich)")
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(params=["mpirun", "torchrun", "srun"])
def engine(request):
    """``launch`` keywords for each real engine; srun runs against the test's own Slurm."""
    if request.param == "mpirun":
        if MPIEXEC is None:
            pytest.skip("mpiexec not installed (pip install mpi4py mpich)")
        return {"launcher": "mpirun"}
    if request.param == "srun":
        request.getfixturevalue("slurm")
        return {"launcher": "srun", "launcher_args": ["--overcommit"]}  # 4 tasks on a 2-CPU node
    return {"launcher": "torchrun"}


def test_engine_gives_the_same_results_as_spawn(engine):
    spawned = nbdist.launch(rankfns.rank_sum, nprocs=4)
    assert nbdist.launch(rankfns.rank_sum, nprocs=4, **engine) == spawned == {r: 10.0 for r in range(4)}


def test_engine_ranks_have_torchrun_env_and_the_marker(engine):
    out = nbdist.launch(rankfns.report_env, nprocs=2, **engine)
    assert {v["env"]["RANK"] for v in out.values()} == {"0", "1"}
    assert {v["env"]["LOCAL_RANK"] for v in out.values()} == {"0", "1"}
    assert all(v["env"]["WORLD_SIZE"] == "2" and v["env"]["MASTER_PORT"] for v in out.values())
    assert all(v["marker_in_exec_env"] and v["backend"] == "gloo" for v in out.values())


def test_engine_fail_fast_names_the_rank(engine):
    run = nbdist.launch(rankfns.fail_on, 2, "raise", nprocs=4, join=False, **engine)
    with pytest.raises(nbdist.WorkerFailedError) as info:
        run.wait(timeout=90)
    assert info.value.rank == 2 and "boom on rank 2" in str(info.value)
    assert run.ended - run.ranks[2].ended < 4.0
    assert not marked_pids(run.run_id)


def test_engine_interrupt_takes_the_engine_ranks_and_dataloader_workers(engine, tmp_path):
    run = nbdist.launch(rankfns.sleep_with_loader, str(tmp_path), nprocs=2, join=False, init_process_group=False,
                        **engine)
    wait_for(lambda: len([f for f in os.listdir(tmp_path) if f.startswith("ready.")]) == 2, 90, what="ranks ready")
    assert len(marked_pids(run.run_id)) >= 6, "engine, 2 ranks and 4 DataLoader workers"
    t0 = time.monotonic()
    report = run.interrupt()
    assert run.status == "interrupted" and not report.survivors
    assert not marked_pids(run.run_id)
    print(f"{engine['launcher']}: interrupt -> nothing left in {time.monotonic() - t0:.2f} s")


def test_engine_dead_parent_leaves_nothing(engine, run_script, tmp_path):
    proc, run_id = start_parent_with_loader_ranks(run_script, tmp_path, **engine)
    assert len(marked_pids(run_id)) >= 6
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    # What holds the GPUs goes first: ranks and their DataLoader workers (they carry RANK).
    wait_for(lambda: not [p for p in nbdist.ps(run_id) if p.rank is not None], 5.0,
             what="ranks and workers to die with their parent")
    ranks_gone = time.monotonic() - t0
    # The engine itself may take a moment more (srun settles the step with slurmctld first).
    wait_for(lambda: not marked_pids(run_id), 15.0, what="the engine to follow")
    print(f"{engine['launcher']}: parent death -> ranks gone in {ranks_gone:.2f} s, "
          f"nothing left in {time.monotonic() - t0:.2f} s")


def test_a_session_under_the_engine_keeps_state_interrupts_and_leaves_nothing(engine, tmp_path):
    """The same session worker under mpirun, torchrun and srun: cells keep their state, the stop
    button brings the ranks back to idle, and closing leaves nothing of the engine's tree."""
    with nbdist.Session(nprocs=2, **engine) as s:
        assert s.wait_ready(120)
        assert s.execute("import torch, torch.distributed as dist\nt = torch.ones(1) * (dist.get_rank() + 1)\n"
                         "dist.all_reduce(t)\nt.item()") == {0: 3.0, 1: 3.0}
        cell = s.execute(began("import time\nwhile True:\n    time.sleep(0.01)", tmp_path / "c"), join=False)
        wait_began(tmp_path / "c", 2)
        cell.interrupt()
        with pytest.raises(nbdist.RunStoppedError):
            cell.wait(30)
        assert s.execute("t.item()") == {0: 3.0, 1: 3.0}, "the ranks kept their state"
        # A rank raises while its peer waits in a collective: released, the group re-formed in place.
        with pytest.raises(nbdist.WorkerFailedError, match="(?s)bad shard.*re-formed in place"):
            s.execute("if dist.get_rank() == 1:\n    time.sleep(0.5)\n    raise ValueError('bad shard')\n"
                      "dist.barrier()")
        assert s.execute("u = torch.ones(1)\ndist.all_reduce(u)\n(u.item(), t.item())") == {0: (2.0, 3.0),
                                                                                           1: (2.0, 3.0)}
        # A rank dies: the session is lost, and the error names that rank, not the peer the engine
        # took down after it (torchrun, which knows its ranks' exits, also gives the signal).
        sid = s.session_id
        with pytest.raises(nbdist.SessionLostError) as info:
            s.execute("import os, signal\nif dist.get_rank() == 1:\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
                      "time.sleep(30)", timeout=60)
        assert "rank 1 failed first" in str(info.value) and s.status == "broken", str(info.value)
        if engine["launcher"] == "torchrun":
            assert "killed by SIGSEGV" in str(info.value), str(info.value)
        # The heal can't add one process to the engine's world: one line, and the way on.
        with pytest.raises(RuntimeError, match=f"nbdist can't heal ranks that {engine['launcher']} started: .*"
                                               f"restart\\(\\) brings new ranks$") as info:
            s.heal()
        assert "\n" not in str(info.value)
    wait_for(lambda: not marked_pids(sid), 15, what=f"the {engine['launcher']} session's tree to go")


@pytest.mark.parametrize("what", ["session", "run"])
def test_a_killed_kernel_leaves_nothing_of_the_engine_and_its_ranks_go_first(engine, run_script, what, tmp_path):
    """SIGKILL a kernel whose session cell is busy (the engine started from the session's own
    thread), or whose run a thread other than the main one started: every rank is gone within
    seconds, the engine after them (the engine's PDEATHSIG from the forker thread, the ranks' own
    watch on the kernel); about 0.3 s on a quiet box, printed."""
    busy = began("import time\nwhile True:\n    time.sleep(0.01)", tmp_path / "c")
    proc = run_script(
        f"""
        import pathlib, sys, threading, time, nbdist
        sys.path.insert(0, {HERE!r})
        import rankfns
        engine = {engine!r}
        if {what!r} == "session":
            s = nbdist.Session(nprocs=2, **engine)
            s.wait_ready(120)
            cell = s.execute({busy!r}, join=False)
            while len(list(pathlib.Path({str(tmp_path / "c")!r}).glob("began.*"))) < 2:
                time.sleep(0.05)
            marker = s.session_id
        else:
            runs = []
            starter = threading.Thread(target=lambda: runs.append(nbdist.launch(
                rankfns.hang, nprocs=2, join=False, init_process_group=False, **engine)))
            starter.start()
            starter.join()
            while len(runs[0].pids) < 2:
                time.sleep(0.05)
            marker = runs[0].run_id
        print("READY", marker, flush=True)
        time.sleep(600)
        """
    )
    line = proc.stdout.readline()
    assert line.startswith("READY"), line + proc.stdout.read()
    marker = line.split()[1]
    assert len(marked_pids(marker)) >= 3, "the engine and its ranks"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    # What holds the GPUs goes first, within seconds; the engine may take a moment more (srun settles
    # the step with slurmctld first), as in test_engine_dead_parent_leaves_nothing.
    wait_for(lambda: not [p for p in nbdist.ps(marker) if p.rank is not None], 5.0,
             what=f"the {engine['launcher']} {what}'s ranks to go")
    ranks_gone = time.monotonic() - t0
    wait_for(lambda: not marked_pids(marker), 15.0, what=f"the {engine['launcher']} {what}'s engine to follow")
    print(f"{engine['launcher']} {what}: kernel SIGKILL -> ranks gone in {ranks_gone:.2f} s, "
          f"nothing left in {time.monotonic() - t0:.2f} s")


# ---- torchrun across kernels ------------------------------------------------------------------
NODE_SCRIPT = """
import json, sys
sys.path.insert(0, {here!r})
import nbdist, rankfns
fn, args = (rankfns.report_world, ()) if sys.argv[4] == "ok" else (rankfns.fail_on, (3, "raise"))
try:
    out = nbdist.launch(fn, *args, nprocs=2, launcher="torchrun", nnodes=2, node_rank=int(sys.argv[1]),
                        master_addr=sys.argv[2], master_port=int(sys.argv[3]), timeout=100)
    print("RESULT " + json.dumps(out), flush=True)
except nbdist.WorkerFailedError as e:
    print("RESULT " + json.dumps({{"error": str(e).split(chr(10))[0]}}), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_node_kernels(script, master_addr, prefix=lambda i: [], extra=(), env=lambda i: None):
    """Two separate processes, node 1 started first, each a kernel running ``script``; each one's
    ``RESULT`` line as ``(node0, node1)``. ``env(k)``: node k's environment (None: this one's)."""
    port = str(_free_port())
    procs = [subprocess.Popen(prefix(k) + [sys.executable, str(script), str(k), master_addr, port, *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(k))
             for k in (1, 0)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=150)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    node1, node0 = (json.loads(o.split("RESULT ", 1)[1]) if "RESULT " in o else pytest.fail(o) for o in outs)
    return node0, node1


def _two_nodes(tmp_path, master_addr, prefix=lambda i: [], mode="ok"):
    """Two kernels with launcher='torchrun', each launching 2 ranks of one world of 4."""
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT.format(here=HERE))
    node0, node1 = _run_node_kernels(script, master_addr, prefix, (mode,))
    if mode == "ok":
        node0, node1 = ({int(k): v for k, v in node.items()} for node in (node0, node1))
    return node0, node1


def _check_world_of_4(node0, node1):
    assert sorted(node0) == [0, 1] and sorted(node1) == [2, 3], "global rank = node_rank * nprocs + local rank"
    for rank, v in {**node0, **node1}.items():
        assert v["rank"] == rank and v["world_size"] == 4 and v["sum"] == 10.0
        assert v["local_rank"] == rank % 2 and v["group_rank"] == rank // 2


def test_two_torchrun_kernels_form_one_world_on_loopback(tmp_path):
    _check_world_of_4(*_two_nodes(tmp_path, "127.0.0.1"))


def test_a_failure_on_one_torchrun_node_ends_both_and_each_names_it(tmp_path):
    t0 = time.monotonic()
    node0, node1 = _two_nodes(tmp_path, "127.0.0.1", mode="fail")
    assert node1["error"].startswith("rank 3 failed first: raised ValueError: boom on rank 3")
    # Node 0's ranks only lost their peers: its error sends the user to the other node, not to rank 0.
    assert node0["error"] == ("ranks 0-1 lost their peers: a rank on another node (ranks 2-3) failed first; "
                              "its kernel and logs have the root cause")
    assert time.monotonic() - t0 < 60, "no kernel waited for its timeout"


SESSION_NODE_SCRIPT = """
import json, os, sys, time
import nbdist
node = int(sys.argv[1])
out = {{}}


def said(e):
    return str(e).split(chr(10))[0] + " | " + str(getattr(e, "note", None) or getattr(e, "report", None))


def stop(cell, press):
    \"\"\"Press stop on ``cell`` (or not: another node's kernel does); what it said, and the seconds to idle.\"\"\"
    t0 = time.monotonic()
    if press:
        cell.interrupt()
    took = time.monotonic() - t0
    try:
        cell.wait(60)
    except (nbdist.WorkerFailedError, nbdist.RunStoppedError) as e:
        return said(e), took
    return None, took


with nbdist.Session(nprocs=2, launcher="torchrun", nnodes=2, node_rank=node, master_addr=sys.argv[2],
                    master_port=int(sys.argv[3])) as s:
    s.wait_ready(120)
    s.execute("import torch, torch.distributed as dist\\nkept = dist.get_rank() * 10", timeout=100)
    out["world"] = s.execute("t = torch.ones(1) * (dist.get_rank() + 1)\\ndist.all_reduce(t)\\n"
                             "(dist.get_world_size(), t.item())", timeout=100)
    out["again"] = s.execute("dist.all_reduce(t)\\n(kept, t.item())", timeout=100)
    try:  # rank 3 raises while every other rank of the world waits in a barrier
        s.execute("import time\\nif dist.get_rank() == 3:\\n    time.sleep(0.5)\\n    raise ValueError('bad shard')\\n"
                  "dist.barrier()", timeout=100)
    except (nbdist.WorkerFailedError, nbdist.RunStoppedError) as e:
        out["failed"] = said(e)
    out["after"] = s.execute("u = torch.ones(1) * (dist.get_rank() + 1)\\ndist.all_reduce(u)\\n(kept, u.item())",
                             timeout=100)
    # Node 1 alone issues a collective (its ranks wait for node 0's, idle) and stops it: node 0,
    # idle, releases its ranks and re-forms with node 1 by itself.
    flag = os.path.join(sys.argv[4], "stray-done")
    if node == 1:
        stray = s.execute("dist.all_reduce(torch.ones(1))", join=False)
        time.sleep(1)
        out["stray"], out["stray_s"] = stop(stray, press=True)
        open(flag, "w").close()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
    # A DDP model trained across both nodes; node 0's stop button stops the world's loop.
    s.execute("from torch.nn.parallel import DistributedDataParallel as DDP\\ntorch.manual_seed(0)\\n"
              "model = DDP(torch.nn.Linear(4, 1))\\nopt = torch.optim.SGD(model.parameters(), lr=0.01)\\n"
              "steps = 0\\ndef step():\\n    global steps\\n    model(torch.ones(8, 4)).sum().backward()\\n"
              "    opt.step()\\n    opt.zero_grad()\\n    steps += 1", timeout=100)
    loop = s.execute("while True:\\n    step()", join=False)
    time.sleep(3)
    out["stopped"], out["stop_s"] = stop(loop, press=node == 0)
    out["trained"] = s.execute("for p in model.parameters():\\n    dist.broadcast(p.data, 0)\\n"
                               "before = steps\\nfor _ in range(3):\\n    step()\\n"
                               "(steps - before, round(sum(p.sum().item() for p in model.parameters()), 5))",
                               timeout=100)
    out["status"] = s.status
    out["sum"] = s.execute("u = torch.ones(1)\\ndist.all_reduce(u)\\nu.item()", timeout=100)
    # A rank of node 1 dies: node 1's session is lost, and node 0's stops at once, saying why.
    if node == 1:
        try:
            s.execute("import os\\nif dist.get_rank() == 3:\\n    os._exit(3)", timeout=100)
        except (nbdist.WorkerFailedError, nbdist.SessionLostError) as e:
            out["died"] = said(e)
    else:
        t0 = time.monotonic()
        while s.status != "broken" and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        out.update(lost=s.lost_reason, lost_s=time.monotonic() - t0)
    out["sid"] = s.session_id
print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_two_node_torchrun_session_keeps_state_and_re_forms_across_both_kernels(tmp_path):
    """Two kernels, each with a session of 2 ranks under torchrun --nnodes 2: one world of 4 whose
    ranks keep their state between cells on both kernels. A rank raising on node 1 and the stop
    button on node 0 each stop the world's cell on both kernels, which re-form the world's groups
    together: the DDP model trains on and sums are right. Closing leaves nothing of either."""
    script = tmp_path / "session_node.py"
    script.write_text(SESSION_NODE_SCRIPT.format())
    node0, node1 = _run_node_kernels(script, "127.0.0.1", extra=(str(tmp_path),))
    check_two_node_session(node0, node1)


def check_two_node_session(node0, node1):
    """What SESSION_NODE_SCRIPT's two kernels must have seen (on loopback, or across two namespaces)."""
    assert node0["world"] == {"0": [4, 10.0], "1": [4, 10.0]} and node1["world"] == {"2": [4, 10.0], "3": [4, 10.0]}
    assert node0["again"] == {"0": [0, 40.0], "1": [10, 40.0]} and node1["again"] == {"2": [20, 40.0], "3": [30, 40.0]}
    # The raise: node 1 names its rank; node 0 names node 1 and the cause; both re-formed, state kept.
    assert node1["failed"].startswith("rank 3 failed first: raised ValueError: bad shard"), node1
    assert "re-formed in place across the 2 nodes' kernels" in node1["failed"], node1
    assert "node 1's part of the cell stopped first: rank 3 raised ValueError: bad shard" in node0["failed"], node0
    assert "re-formed in place across the 2 nodes' kernels" in node0["failed"], node0
    assert node0["after"] == {"0": [0, 10.0], "1": [10, 10.0]} and node1["after"] == {"2": [20, 10.0], "3": [30, 10.0]}
    # The stop button on node 0 only: node 1's part stopped too, saying why; both re-formed.
    assert node0["stop_s"] < 5, node0
    assert node0["stopped"].startswith("the run was interrupted"), node0
    assert node1["stopped"].startswith("the run was interrupted"), node1
    assert "node 0's part of the cell stopped first: it was interrupted; the process group was re-formed" in node1["stopped"], node1
    trained = {**node0["trained"], **node1["trained"]}
    assert {v[0] for v in trained.values()} == {3} and len({v[1] for v in trained.values()}) == 1, trained
    assert set({**node0["sum"], **node1["sum"]}.values()) == {4.0}
    assert node0["status"] == node1["status"] == "idle"
    # Node 1's stray collective, stopped there, was released by node 0's idle ranks.
    assert node1["stray"].startswith("the run was interrupted"), node1
    assert "re-formed in place across the 2 nodes' kernels" in node1["stray"] and node1["stray_s"] < 5, node1
    # A rank died on node 1: its session is lost, and node 0's part stops within seconds, naming node 1.
    assert "rank 3" in node1["died"] and "exit" in node1["died"], node1
    # Node 1's kernel says so the moment rank 3's channel closes; torchrun's agents end the world's
    # store about 0.1 s later, which node 0 then reads as the same news, if it comes first. A kernel
    # slower to read than torchrun's agent (a busy box) finds rank 2's channel closed too (the agent
    # took it down): it can't tell which went first and names both, never rank 2 alone (CI, once).
    lost = "the session was stopped: node 1's part of the world was lost "
    assert node0["lost"].startswith((lost + "(rank 3 ended)", lost + "(ranks 2-3 ended)",
                                     "the session was stopped: the world's store closed")), node0
    assert node0["lost_s"] < 10, node0
    for node in (node0, node1):
        wait_for(lambda: not marked_pids(node["sid"]), 10, what="the node's session tree to go")


HOST_SCRIPT = """
import json, sys
sys.path.insert(0, {here!r})
import nbdist, rankfns
run = nbdist.launch(rankfns.report_world, nprocs=2, launcher="torchrun", nnodes=2, master_addr="127.0.0.1",
                    master_port={port}, run_dir={shared!r}, join=False, timeout=100)
print("JOIN " + run.launcher.node_command(1), flush=True)
print("RESULT " + json.dumps(run.wait()), flush=True)
"""


def test_a_kernel_and_a_torchrun_started_by_hand_form_one_world(tmp_path):
    shared = tmp_path / "shared-runs"  # what another machine would mount
    script = tmp_path / "host.py"
    script.write_text(HOST_SCRIPT.format(here=HERE, port=_free_port(), shared=str(shared)))
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        join = kernel.stdout.readline()
        assert join.startswith("JOIN NBDIST_NODE_RANK=1 torchrun --nnodes 2 --nproc-per-node 2"), join
        assert "-m nbdist.worker " + str(shared) in join and "is_host=false" in join
        env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
                   PYTHONPATH=HERE, OMP_NUM_THREADS="1")
        by_hand = subprocess.run(["bash", "-c", join[len("JOIN "):]], env=env, capture_output=True, text=True,
                                 timeout=120)
        assert by_hand.returncode == 0, by_hand.stdout + by_hand.stderr
        out = kernel.communicate(timeout=60)[0]
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()
    node0 = {int(k): v for k, v in json.loads(out.split("RESULT ", 1)[1]).items()}
    assert sorted(node0) == [0, 1] and all(v["world_size"] == 4 and v["sum"] == 10.0 for v in node0.values())
    # The hand-started node's ranks wrote their results into the shared run dir, as global ranks 2 and 3
    # (the kernel's own, 0 and 1, it read and removed with the payload: the logs are what stays).
    run_dir = next(shared.iterdir())
    assert sorted(p.name for p in run_dir.glob("result.*.pkl")) == ["result.2.pkl", "result.3.pkl"]
    assert not (run_dir / "payload.pkl").exists() and (run_dir / "rank2.stderr").exists()


def test_two_torchrun_kernels_across_network_namespaces(tmp_path):
    from clusters import NetnsPair, netns_missing

    why = netns_missing()
    if why:
        pytest.skip(why)
    pair = NetnsPair.create(str(os.getpid() % 10000))
    try:
        node0, node1 = _two_nodes(tmp_path, pair.addrs[0], prefix=lambda k: pair.command(k, []))
    finally:
        pair.remove()
    _check_world_of_4(node0, node1)
    # Each node's ranks advertised their own namespace's address, not loopback.
    assert {v["master_addr"] for v in {**node0, **node1}.values()} <= set(pair.addrs)
    assert {v["gloo_ifname"] for v in {**node0, **node1}.values()} == {pair.ifname}


def test_torchrun_with_nnodes_needs_master_port():
    with pytest.raises(nbdist.LaunchConfigError, match="nnodes=2 needs master_port="):
        nbdist.launch(rankfns.rank_sum, nprocs=2, launcher="torchrun", nnodes=2)
    with pytest.raises(nbdist.LaunchConfigError, match="node_rank=2 must be in 0..1"):
        nbdist.launch(rankfns.rank_sum, nprocs=2, launcher="torchrun", nnodes=2, node_rank=2, master_port=1234)


# ---- run dir and missing engines --------------------------------------------------------------
@needs_mpi
def test_ranks_that_cant_read_the_run_dir_say_so_in_one_line(tmp_path):
    class OtherNodeLauncher(MpirunLauncher):
        """Ranks on a node where the kernel's run dir does not exist (no shared filesystem)."""

        def command(self, run_dir, nprocs):
            return super().command(str(tmp_path / "not-shared" / os.path.basename(run_dir)), nprocs)

    run = start_run(rankfns.rank_sum, (), {}, WorldOptions(nprocs=2), launcher=OtherNodeLauncher())
    with pytest.raises(nbdist.WorkerFailedError) as info:
        run.wait(timeout=60)
    assert "is not readable here; put the run dir on a shared path" in str(info.value)
    assert info.value.failures[info.value.rank].exc_type is None


@pytest.mark.parametrize("launcher, says", [
    ("mpirun", r"launcher='mpirun' needs mpiexec.*pip install 'nbdist\[mpi\]'"),
    ("srun", r"launcher='srun' needs Slurm's srun.*apt-get install slurm-wlm"),
])
def test_missing_engine_is_one_clear_line(monkeypatch, launcher, says):
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    with pytest.raises(nbdist.LaunchConfigError, match=says):
        nbdist.launch(lambda: 1, nprocs=2, launcher=launcher)


def test_missing_torchrun_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(nbdist.LaunchConfigError, match=r"launcher='torchrun' needs torch.*pip install torch"):
        nbdist.launch(lambda: 1, nprocs=2, launcher="torchrun")


# ---- output of ranks on other machines --------------------------------------------------------
@needs_mpi
def test_output_of_remote_ranks_streams_over_the_authenticated_channel(tmp_path, monkeypatch):
    """Ranks "on another machine" (forced here: one machine) mirror their logs to the kernel live.

    The kernel's view of the log files is frozen, as a shared filesystem's can be for seconds,
    so every line the kernel shows has come through the channel, each exactly once.
    """
    from multiprocessing.connection import Client

    from nbdist.run.output import LogFollower

    monkeypatch.setattr(LogFollower, "read_new", lambda self: "")
    run = nbdist.launch(rankfns.talk_then_wait, str(tmp_path), nprocs=2, launcher="mpirun", join=False,
                        env={"NBDIST_MIRROR_OUTPUT": "1"})
    wait_for(lambda: len([f for f in os.listdir(tmp_path) if f.startswith("ready.")]) == 2, 90, what="ranks ready")
    # Live: while the ranks still run, their lines are here, from the channel alone.
    wait_for(lambda: all(out.total_lines == 21 for out in run.outputs.values()), 10, what="lines via the channel")
    # A peer without the run's key is refused, and the run goes on.
    with pytest.raises(Exception):
        Client(tuple(run.spec.output_channel), family="AF_INET", authkey=b"not the key").send_bytes(b"x" * 20)
    wait_for(lambda: run.channel.refused == 1, 5, what="the refusal")
    (tmp_path / "go").touch()
    assert run.wait(timeout=60) == {0: 0, 1: 1}
    for rank, out in run.outputs.items():
        # Each stream in its order (between the two streams the mirror keeps no order, nor does a terminal).
        assert [line for s, line in out.lines if s == "stdout"] == [f"line {i} from rank {rank}" for i in range(20)]
        assert [line for s, line in out.lines if s == "stderr"] == [f"to stderr from rank {rank}"]
        sizes = sum(os.path.getsize(os.path.join(run.run_dir, f"rank{rank}.{s}")) for s in ("stdout", "stderr"))
        assert sum(f.fed for f in out.followers.values()) == sizes, "the log files hold exactly what was streamed"


def test_a_rank_on_the_kernels_machine_does_not_mirror(monkeypatch):
    from nbdist.worker.output_mirror import should_mirror

    monkeypatch.delenv("NBDIST_MIRROR_OUTPUT", raising=False)
    assert not should_mirror(socket.gethostname())
    assert should_mirror("some-other-node")
    assert not should_mirror(None)


@needs_mpi
def test_ranks_that_may_run_elsewhere_need_an_address_they_can_reach(monkeypatch, tmp_path):
    from nbdist.launchers import choose_master_addr, make_engine_launcher

    hostfile = ["--hostfile", str(tmp_path / "hosts")]
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # Debian's usual /etc/hosts line
    with pytest.raises(nbdist.LaunchConfigError, match="its hostname resolves to 127.0.1.1: pass master_addr="):
        nbdist.launch(rankfns.rank_sum, nprocs=2, launcher="mpirun", launcher_args=hostfile)
    assert not marked_pids()
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.1.2.3")
    assert choose_master_addr(make_engine_launcher("mpirun", hostfile), None) == "10.1.2.3"
    assert choose_master_addr(make_engine_launcher("mpirun", hostfile), "192.168.0.7") == "192.168.0.7"
    assert choose_master_addr(make_engine_launcher("mpirun"), None) == "127.0.0.1", "one machine: loopback"
    assert choose_master_addr(None, None) == "127.0.0.1"
