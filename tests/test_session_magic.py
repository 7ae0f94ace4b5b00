"""The notebook's session through a real IPython kernel: %dist_start, cells in it, the stop button,
%dist_stacks, %dist_stop, and a kernel that dies. Driven through jupyter_client."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import marked_pids, nbdist_kernel, wait_for


@pytest.fixture(params=["spawn", "warm"])
def kernel(request):
    with nbdist_kernel(request.param) as k:
        yield k


def _session_id(kernel) -> str:
    return kernel.run("from nbdist.frontend.session_magics import live_session\nlive_session().session_id").result.strip("'")


def test_a_session_keeps_the_model_between_cells_and_shows_each_cells_output(kernel):
    res = kernel.run("%dist_start -n 2")
    assert res.status == "ok" and "starting 2 ranks" in res.stdout, res.error_text
    res = kernel.run("%%distributed --view text\nimport torch, torch.distributed as dist\n"
                     "torch.manual_seed(0)\nmodel = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))\n"
                     "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                     "X = torch.randn(32, 4, generator=torch.Generator().manual_seed(dist.get_rank()))\n"
                     "def step():\n    opt.zero_grad()\n    loss = (model(X) ** 2).mean()\n    loss.backward()\n"
                     "    opt.step()\n    return loss.item()\n"
                     "print('built on rank', dist.get_rank())\nstep()")
    assert res.status == "ok", res.error_text + res.stdout
    assert "[rank 0] built on rank 0" in res.stdout and "[rank 1] built on rank 1" in res.stdout
    first = float(res.result)
    losses = []
    for _ in range(2):
        res = kernel.run("%%distributed --view text\nfor _ in range(10):\n    loss = step()\nprint('loss', loss)\nloss")
        assert res.status == "ok", res.error_text
        assert "built on rank" not in res.stdout, "each cell shows its own output only"
        losses.append(float(res.result))
    assert first > losses[0] > losses[1], (first, losses)
    res = kernel.run("%%distributed --view text --ranks 1\nprint('only', dist.get_rank())\ndist.get_rank()")
    assert res.status == "ok" and res.result == "1" and "[rank 1] only 1" in res.stdout and "[rank 0]" not in res.stdout
    assert kernel.run("type(_dist).__name__").result == "'CellHandle'"
    # A --ranks cell moved rank 1's replica alone; %dist_sync brings it back to rank 0's.
    kernel.run("%%distributed --view text --ranks 1\nwith torch.no_grad():\n    model.module.weight.add_(1)")
    res = kernel.run("%dist_sync")
    assert res.status == "ok" and "re-synced 1 DDP model" in res.stdout and "from rank 0" in res.stdout, res.stdout
    res = kernel.run("%%distributed --view text\nround(model.module.weight.sum().item(), 6)")
    assert "[rank 0]" not in res.stdout and res.status == "ok"
    res = kernel.run("from nbdist.frontend.session_magics import live_session as _ls\n"
                     "len(set(_ls().execute('model.module.weight.sum().item()').values()))")
    assert res.result == "1", res.result
    # A notebook variable of a name the ranks defined does not overwrite the ranks' own.
    kernel.run("model = 'the notebook has its own model'")
    res = kernel.run("%%distributed --view text\ntype(model).__name__")
    assert res.result == "'DistributedDataParallel'", res.result
    res = kernel.run("%%distributed -n 4 --view text\n1")
    assert res.status == "error" and "this cell asks for --nprocs 4" in res.error_text and "--fresh" in res.error_text
    res = kernel.run("%%distributed -n 2 --fresh --view text\nimport os\nos.environ['NBDIST_RUN_ID'] != "
                     f"{_session_id(kernel)!r}")
    assert res.status == "ok" and res.result == "True", res.error_text
    sid = _session_id(kernel)
    res = kernel.run("%dist_stop")
    assert "stopped (2 ranks)" in res.stdout
    wait_for(lambda: not marked_pids(sid), 3, what="the session's ranks to go")


def test_a_cell_sent_while_the_session_starts_waits_and_shows_the_ranks_come_up(kernel):
    res = kernel.run("%dist_start -n 2 --start spawn")  # spawned ranks take seconds to come up
    assert res.status == "ok", res.error_text
    res = kernel.run("%%distributed --view text\nimport os\nint(os.environ['RANK'])")
    assert res.status == "ok" and res.result == "0", res.error_text
    assert "this cell waits for session" in res.stdout and "of 2 up so far" in res.stdout, res.stdout
    assert any("application/vnd.jupyter.widget-view+json" in d for d in res.displays), "the ranks' progress"
    kernel.run("%dist_stop")


def test_errors_show_cell_lines_and_the_stop_button_keeps_the_state(kernel, tmp_path):
    kernel.run("%dist_start -n 2")
    # Not in the cell that raises: a rank failing in its first millisecond stops a peer that had not
    # begun that cell yet, which then runs none of it (imports included).
    assert kernel.run("%%distributed --view text\nimport time, torch.distributed as dist\nkept = [1, 2, 3]").status == "ok"
    res = kernel.run("%%distributed --view text\nx = 1\ny = 2\n"
                     "def shard(r):\n    raise KeyError(f'shard {r}')\nshard(dist.get_rank())")
    assert res.status == "error" and res.error["ename"] == "WorkerFailedError", res.error_text
    assert "KeyError" in res.error_text and 'cell.py", line 6' in res.error_text and 'line 5' in res.error_text
    ready = tmp_path / "looping"
    msg_id = kernel.send(f"%%distributed --view text\nn = 0\nopen({str(ready)!r} + str(dist.get_rank()), 'w').close()\n"
                         "while True:\n    n += 1\n    time.sleep(0.001)")
    wait_for(lambda: len(list(tmp_path.glob("looping*"))) == 2, 60, what="both ranks in the loop")
    t0 = time.monotonic()
    kernel.km.interrupt_kernel()
    res = kernel.collect(msg_id, timeout=30)
    took = time.monotonic() - t0
    assert res.status == "error" and res.error["ename"] == "RunStoppedError", res.error_text
    assert "idle again, their state kept" in res.error_text
    print(f"stop button on a session cell -> idle in {took:.2f} s")
    res = kernel.run("%%distributed --view text\n(sum(kept), n > 0)")
    assert res.status == "ok" and res.result == "(6, True)", res.error_text
    res = kernel.run("%dist_stacks")
    assert res.status == "ok" and "===== rank 0" in res.stdout and "===== rank 1" in res.stdout, res.stdout
    assert "session_rank.py" in res.stdout or "serve_session" in res.stdout or "recv" in res.stdout
    kernel.run("%dist_stop")


def test_a_ddp_model_survives_a_raising_rank_and_the_stop_button_with_a_rank_stuck_in_backward(kernel, tmp_path):
    kernel.run("%dist_start -n 2")
    res = kernel.run("%%distributed --view text\nimport pathlib, time, torch, torch.distributed as dist\n"
                     "torch.manual_seed(0)\nmodel = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))\n"
                     "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
                     "X = torch.randn(64, 8, generator=torch.Generator().manual_seed(dist.get_rank()))\n"
                     "def step():\n    opt.zero_grad()\n    loss = ((model(X) - X.sum(1, keepdim=True)) ** 2).mean()\n"
                     "    loss.backward()\n    opt.step()\n    return loss.item()\nround(step(), 6)")
    assert res.status == "ok", res.error_text
    first = float(res.result)
    # Rank 1 raises (after a slow read) while rank 0 waits for it in DDP's gradient all-reduce.
    res = kernel.run("%%distributed --view text\nfor i in range(10**6):\n    if i == 5 and dist.get_rank() == 1:\n"
                     "        time.sleep(0.5)\n        raise OSError('corrupt shard')\n    step()")
    assert res.status == "error" and "rank 1 failed first" in res.error_text, res.error_text
    assert "corrupt shard" in res.error_text and "re-formed in place" in res.error_text, res.error_text
    # The stop button while rank 1 waits in backward for rank 0, which sleeps in Python.
    marker = tmp_path / "asleep"
    msg_id = kernel.send(f"%%distributed --view text\nfor i in range(10**6):\n    if i == 10 and dist.get_rank() == 0:\n"
                         f"        pathlib.Path({str(marker)!r}).touch()\n        time.sleep(600)\n    step()")
    wait_for(marker.exists, 60, what="rank 0 to stop at step 10")
    time.sleep(1.0)  # rank 1 in its next backward's all_reduce (milliseconds on a quiet box; the kernel is busy)
    t0 = time.monotonic()
    kernel.km.interrupt_kernel()
    res = kernel.collect(msg_id, timeout=30)
    took = time.monotonic() - t0
    assert res.status == "error" and res.error["ename"] == "RunStoppedError", res.error_text
    assert "idle again, their state kept" in res.error_text and "rank 1 waited in a collective" in res.error_text
    res = kernel.run("%%distributed --view text\nt = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\n"
                     "(t.item(), round([step() for _ in range(10)][-1], 6) < " + repr(first) + ")")
    assert res.status == "ok" and res.result == "(3.0, True)", res.error_text or res.result
    print(f"stop button, a rank stuck in DDP backward (real kernel) -> idle in {took:.2f} s")
    kernel.run("%dist_stop")


def test_a_dying_rank_is_said_and_restart_brings_the_full_session_back(kernel):
    kernel.run("%dist_start -n 2")
    sid = _session_id(kernel)
    res = kernel.run("%%distributed --view text\nimport os\nif os.environ['RANK'] == '1':\n    os.kill(os.getpid(), 9)\n"
                     "import time\ntime.sleep(60)")
    assert res.status == "error" and "rank 1 failed first: killed by SIGKILL" in res.error_text, res.error_text
    res = kernel.run("%%distributed --view text\n1")  # the survivor keeps its state: the session is degraded
    said = next(line for line in res.stderr.splitlines() if "UsageError" in line)  # the cell's one line
    assert res.status == "error" and said.count("%dist_restart") == 1 and "restart()" not in said, said
    assert "rank 1 was killed by SIGKILL" in said and "%dist_heal" in said and "--ranks 0 " in said, said
    assert kernel.run("%dist_restart").status == "ok"
    wait_for(lambda: not marked_pids(sid), 3, what="the old session's tree to go")
    res = kernel.run("%%distributed --view text\nimport torch.distributed as dist\ndist.get_world_size()")
    assert res.status == "ok" and res.result == "2", res.error_text
    kernel.run("%dist_stop")


def test_a_killed_kernel_leaves_no_session_rank(kernel):
    kernel.run("%dist_start -n 2")
    kernel.run("%%distributed --view text\nimport torch\nx = torch.ones(1)")
    sid = _session_id(kernel)
    assert len(marked_pids(sid)) >= 2
    os.kill(kernel.pid, signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(lambda: not marked_pids(sid), 3, what="the session's ranks to die with the kernel")
    print(f"kernel SIGKILL -> session gone in {time.monotonic() - t0:.2f} s")


def test_rich_output_rank_0s_figure_is_the_cells_own_and_the_others_go_to_their_tab(kernel):
    kernel.run("%dist_start -n 2")
    res = kernel.run("%%distributed\nimport torch.distributed as dist\nimport matplotlib.pyplot as plt\n"
                     "from IPython.display import display, HTML\n"
                     "plt.plot([1, 3, 2])\nplt.title(f'loss on rank {dist.get_rank()}')\nplt.show()\n"
                     "display(HTML(f'<b>hello from rank {dist.get_rank()}</b>'))\nprint('text still streams')")
    assert res.status == "ok", res.error_text
    pngs = [d for d in res.displays if "image/png" in d]
    html = [d["text/html"] for d in res.displays if "text/html" in d]
    assert len(pngs) == 1 and html == ["<b>hello from rank 0</b>"], res.displays
    tab_outputs = [o for outs in res.widget_outputs.values() for o in outs if o.get("output_type") == "display_data"]
    assert any("hello from rank 1" in str(o["data"].get("text/html")) for o in tab_outputs), tab_outputs
    assert any("image/png" in o["data"] for o in tab_outputs), "rank 1's figure is in its tab"
    assert "hello from rank 0" not in str(tab_outputs)
    assert any("text still streams" in t for t in res.widget_text())
    kernel.run("%dist_stop")


@pytest.mark.parametrize("how", ["restart", "shutdown"])
def test_kernel_restart_and_closing_the_notebook_leave_no_session_rank(kernel, how):
    kernel.run("%dist_start -n 2")
    kernel.run("%%distributed --view text\nimport torch\nx = torch.ones(1)")
    sid = _session_id(kernel)
    res = kernel.run("%dist_ps")
    assert sid in res.stdout and res.stdout.count(sid) >= 2, "%dist_ps lists the session's ranks"
    t0 = time.monotonic()
    if how == "restart":
        kernel.km.restart_kernel(now=True)  # the kernel menu's Restart
    else:
        kernel.km.shutdown_kernel(now=False)  # closing the notebook: a polite shutdown, atexit runs
    wait_for(lambda: not marked_pids(sid), 3, what=f"the session's ranks to go with a kernel {how}")
    print(f"kernel {how} -> session gone in {time.monotonic() - t0:.2f} s")


def test_dist_kill_in_one_kernel_leaves_another_kernels_session_alone(kernel):
    """Two notebooks, a session each: %dist_ps in one says whose each process is, and %dist_kill
    there stops its own session only; the other notebook's session keeps its state."""
    with nbdist_kernel("warm") as other:
        assert other.run("%dist_start -n 2").status == "ok"
        assert other.run("%%distributed --view text\nkept = 41\nkept + 1").result == "42"
        theirs = _session_id(other)
        kernel.run("%dist_start -n 2")
        kernel.run("%%distributed --view text\nx = 1")
        mine = _session_id(kernel)
        res = kernel.run("%dist_ps")
        assert mine in res.stdout and theirs in res.stdout, res.stdout
        assert f"kernel pid {other.pid}" in res.stdout and "this kernel" in res.stdout, res.stdout
        res = kernel.run("%dist_kill")
        assert res.status == "ok" and "stopped 2 processes" in res.stdout, res.stdout + res.error_text
        wait_for(lambda: not marked_pids(mine), 5, what="this kernel's session to go")
        assert len(marked_pids(theirs)) >= 2, "the other notebook's session is alone"
        assert other.run("%%distributed --view text\nkept").result == "41"
        other.run("%dist_stop")


def test_notebook_sources_go_to_a_session_s_ranks_once_and_their_tracebacks_keep_them(kernel):
    """A rank's traceback shows the lines of notebook functions it runs; the sources travel with
    the first cell that every rank got, not again with each later cell (a long notebook would
    send all of itself each time)."""
    assert kernel.run("%dist_start -n 2").status == "ok"
    kernel.run("def scale(v):\n    if v > 10:\n        raise ValueError('too big: %d' % v)\n    return v * 2\n")
    held = ("from nbdist.frontend.session_magics import live_session\n"
            "scale.__code__.co_filename in live_session().incarnation.sources_held")
    assert kernel.run(held).result == "False"
    res = kernel.run("%%distributed --view text\nscale(2)")
    assert res.status == "ok" and res.result == "4", res.error_text
    assert kernel.run(held).result == "True", "every rank holds it now: later cells leave it out"
    kernel.run("%%distributed --view text\nscale(3)")
    res = kernel.run("%%distributed --view text\nscale(11)")
    assert res.status == "error" and "raise ValueError('too big: %d' % v)" in res.error_text, res.error_text
    kernel.run("%dist_restart")  # new ranks hold nothing: the sources travel again
    assert kernel.run(held).result == "False"
    res = kernel.run("%%distributed --view text\nscale(12)")
    assert "raise ValueError('too big: %d' % v)" in res.error_text, res.error_text


def test_a_payload_leaves_out_the_sources_the_ranks_hold(tmp_path):
    import linecache
    import pickle

    from nbdist.protocol import rundir

    cell = "/nonexistent/ipykernel_1/cell_a.py"  # a notebook cell: in linecache only
    linecache.cache[cell] = (10, None, ["x = 1\n"], cell)
    try:
        sent = rundir.write_payload(str(tmp_path), print)
        assert cell in sent and pickle.load(open(tmp_path / "payload.pkl", "rb"))["sources"][cell] == ["x = 1\n"]
        again = rundir.write_payload(str(tmp_path), print, sources_held=sent)
        assert cell not in again and cell not in pickle.load(open(tmp_path / "payload.pkl", "rb"))["sources"]
    finally:
        linecache.cache.pop(cell, None)


def test_a_name_bound_inside_a_session_cell_s_function_keeps_the_notebook_s_value_coming():
    """A cell's function binds ``x`` in its own scope: that is no name of the ranks, so a later cell
    that reads the notebook's ``x`` is sent it (it met a NameError while the magic took every name
    bound anywhere in a cell for the ranks')."""
    with nbdist_kernel("warm") as k:
        assert k.run("%dist_start -n 2").status == "ok"
        res = k.run("%%distributed --view text\ndef total(n):\n    x = 0\n    for i in range(n):\n"
                    "        x += i\n    return x\nprint('total', total(4))")
        assert res.status == "ok" and "[rank 1] total 6" in res.stdout, res.error_text + res.stdout
        assert k.run("x = 41").status == "ok"
        res = k.run("%%distributed --view text\nprint('x', x + 1)")
        assert res.status == "ok" and "[rank 0] x 42" in res.stdout and "[rank 1] x 42" in res.stdout, \
            res.error_text + res.stdout
        k.run("%dist_stop")
