"""``%%distributed`` in a real IPython kernel, driven through jupyter_client."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import marked_pids, nbdist_kernel, wait_for
from kernel_client import Kernel


@pytest.fixture(scope="module", params=["spawn", "warm"])
def kernel(request):
    """One kernel per start method: its cells spawn ranks, or fork them from its warm template."""
    with nbdist_kernel(request.param) as k:
        yield k


def spawn_only(kernel):
    """Tests of engines (mpirun, torchrun, srun) or of option checks: the start method changes nothing."""
    if kernel.start_method != "spawn":
        pytest.skip("no ranks of this kernel's own here: run once, with spawn")


LOADER_CELL = """
import os, time, torch
class Slow(torch.utils.data.Dataset):
    def __len__(self): return 100000
    def __getitem__(self, i):
        time.sleep(0.05)
        return i
it = iter(torch.utils.data.DataLoader(Slow(), num_workers=2))
next(it)
open(os.path.join(READY, f"ready.{os.environ['RANK']}"), "w").close()
while True:
    next(it)
"""


def test_text_view_shows_every_rank_and_returns_rank_0_value(kernel):
    res = kernel.run("%%distributed -n 2 --view text\nimport torch.distributed as dist\n"
                     "print('hello from', dist.get_rank())\ndist.get_rank() + 40")
    assert res.status == "ok", res.error_text
    assert "[rank 0] hello from 0" in res.stdout and "[rank 1] hello from 1" in res.stdout
    assert "finished: 2 ranks" in res.stdout
    assert res.result == "40"
    assert kernel.run("_dist.results").result == "{0: 40, 1: 41}"


def test_widget_view_has_a_tab_per_rank(kernel):
    res = kernel.run("%%distributed -n 2 --view widget\nimport sys, torch.distributed as dist\n"
                     "print('out of', dist.get_rank())\nprint('err of', dist.get_rank(), file=sys.stderr)")
    assert res.status == "ok", res.error_text
    assert any("application/vnd.jupyter.widget-view+json" in d for d in res.displays)
    texts = res.widget_text()
    assert any(t == "out of 0\nerr of 0\n" or ("out of 0" in t and "of 1" not in t) for t in texts), texts
    assert any("out of 1" in t and "of 0" not in t for t in texts), texts
    assert any("[0] out of 0" in t and "[1] out of 1" in t for t in texts), "the 'all' tab interleaves ranks"
    stderr_outputs = [o for outs in res.widget_outputs.values() for o in outs if o.get("name") == "stderr"]
    assert any("err of 1" in o["text"] for o in stderr_outputs), "stderr stays stderr (shown red)"
    assert any("finished" in v for v in res.widget_values.values() if isinstance(v, str))


def test_class_and_function_from_the_cell_work_under_ddp(kernel):
    res = kernel.run(
        "%%distributed -n 2 --view text\n"
        "import inspect, torch, torch.nn as nn\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(4, 1)\n"
        "    def forward(self, x):\n"
        "        return self.lin(x)\n"
        "def step(model):\n"
        "    torch.manual_seed(0)\n"
        "    model(torch.randn(8, 4)).sum().backward()\n"
        "    return [p.grad.sum().item() for p in model.parameters()]\n"
        "torch.manual_seed(1)\n"
        "grads = step(DDP(Net()))\n"
        "(grads, 'def step(model)' in inspect.getsource(step), Net.__module__)"
    )
    assert res.status == "ok", res.error_text + res.stdout
    values = eval(kernel.run("_dist.results").result)
    assert values[0] == values[1], "DDP averaged the same gradients on both ranks"
    assert values[0][1] is True and values[0][2] == "__main__"


def test_notebook_functions_travel_and_unrelated_unpicklable_values_do_not_matter(kernel):
    assert kernel.run("import threading\nlock = threading.Lock()\n"
                      "def helper(x):\n    return x * SCALE\nSCALE = 3").status == "ok"
    res = kernel.run("%%distributed -n 2 --view text\nhelper(nbdist_rank := __import__('nbdist').rank())")
    assert res.status == "ok", res.error_text
    assert kernel.run("_dist.results").result == "{0: 0, 1: 3}"
    res = kernel.run("%%distributed -n 2 --view text\nwith lock:\n    pass")
    assert res.status == "error" and res.error["ename"] == "UsageError"
    assert "notebook variable 'lock' of type _thread.lock can't be sent to the ranks" in res.error["evalue"]
    assert "\n" not in res.error["evalue"]


def test_pull_brings_rank_0_values_back(kernel):
    res = kernel.run("%%distributed -n 2 --view text --pull loss,curve\nimport os\n"
                     "loss = 0.5 + int(os.environ['RANK'])\ncurve = [1.0, 0.7, loss]")
    assert res.status == "ok", res.error_text
    assert kernel.run("(loss, curve)").result == "(0.5, [1.0, 0.7, 0.5])"


def test_big_values_travel_mapped_and_leave_nothing_in_the_run_dir(kernel):
    """A 16 MB tensor and a numpy array in and out of a one-shot cell: the ranks map the kernel's
    one written copy (each rank's writes stay its own), rank 0's --pull and return value come back
    mapped the same way, and the run dir keeps none of it once the cell ended."""
    kernel.run("import torch, numpy as np\nbig = torch.arange(4 << 20, dtype=torch.float32)\n"
               "arr = np.ones((512, 1024))")
    res = kernel.run("%%distributed -n 2 --view text --push arr --pull out,arr\nimport os, torch\n"
                     "r = int(os.environ['RANK'])\nbig[0] = r - 1\narr *= r + 2\n"
                     "out = torch.full((1 << 20,), float(r))\n(float(big[0]), float(big[-1]), float(arr.sum()))")
    assert res.status == "ok", res.error_text
    assert res.result == repr((-1.0, float((4 << 20) - 1), float(512 * 1024 * 2))), "rank 0's own copy"
    checks = kernel.run("import os\n(float(big[0]), float(out.sum()), float(arr.sum()), "
                        "sorted(f for f in os.listdir(_dist.run_dir) if f.endswith('.pkl')))")
    assert checks.result == f"(0.0, 0.0, {float(512 * 1024 * 2)}, [])", "the notebook's own values untouched"


def test_failing_rank_shows_root_cause_with_the_editors_line(kernel):
    res = kernel.run(
        "%%distributed -n 3 --view text\n"          # line 1
        "import torch.distributed as dist\n"        # line 2
        "def check(r):\n"                           # line 3
        "    if r == 1:\n"                          # line 4
        "        raise ValueError('bad shard')\n"   # line 5
        "check(dist.get_rank())\n"                  # line 6
        "dist.barrier()\n"                          # line 7
    )
    assert res.status == "error", "Run All must stop here"
    assert res.error["ename"] == "WorkerFailedError"
    text = res.error_text
    assert "rank 1 failed first" in text and "ValueError: bad shard" in text
    assert 'cell.py", line 5, in check' in text and 'cell.py", line 6, in <module>' in text
    assert "nbdist/worker.py" not in text and "site-packages" not in text, "only the user's frames"
    assert "full traceback:" in text and "rank1.stderr" in text
    assert text.count("ValueError: bad shard") == 2  # the summary line and the traceback's last line


def test_tqdm_bar_is_one_updating_line(kernel):
    cell = ("%%distributed -n 2 {view}\nimport time, os\nfrom tqdm import tqdm\n"
            "if os.environ['RANK'] == '0':\n    for _ in tqdm(range(40), mininterval=0.01):\n        time.sleep(0.02)\n"
            "print('done')")
    res = kernel.run(cell.format(view="--view text"))
    assert res.status == "ok", res.error_text
    bar_lines = [line for line in res.stdout.splitlines() if "40/40" in line or "it/s" in line or "%|" in line]
    assert len(bar_lines) == 1 and "100%" in bar_lines[0], res.stdout
    res = kernel.run(cell.format(view="--view widget"))
    rank0 = [t for t in res.widget_text() if "done" in t and "[0]" not in t]
    assert rank0, res.widget_text()
    assert all(sum("%|" in line for line in t.splitlines()) <= 1 for t in res.widget_text()), res.widget_text()


def test_bg_returns_at_once_then_wait(kernel, tmp_path):
    """The --bg cell returns while its ranks still run: they wait for a file only the test writes after."""
    flag = str(tmp_path / "go")
    res = kernel.run(f"%%distributed -n 2 --bg --view text\nimport os, time\nfor _ in range(1200):\n"
                     f"    if os.path.exists({flag!r}):\n        break\n    time.sleep(0.05)\n'slept'")
    assert res.status == "ok", res.error_text
    assert kernel.run("_dist.status").result in ("'starting'", "'running'"), "returned before its ranks ended"
    open(flag, "w").close()
    res = kernel.run("_dist.wait()")
    assert res.status == "ok" and res.result == "{0: 'slept', 1: 'slept'}"


def test_refused_cells_leave_no_run_dir(kernel, tmp_path):
    spawn_only(kernel)
    kernel.run("import threading\nlock = threading.Lock()")
    for cell, says in [("print(lock)", "notebook variable 'lock'"), ("print(1 +)", "SyntaxError"),
                       ("--push nowhere_defined\n1", "--push: no variable named"),
                       ("-n 10000\n1", "--nprocs=10000 is more ranks than this machine can sensibly run")]:
        head, _, body = cell.rpartition("\n") if cell.startswith("-") else ("", "", cell)
        res = kernel.run(f"%%distributed -n 2 --run-dir {tmp_path} {head}\n{body}")
        assert res.status == "error" and says in res.error_text + str(res.error), (cell, res.error_text)
        assert os.listdir(tmp_path) == [], f"{cell!r} left {os.listdir(tmp_path)}"
    assert not marked_pids()


def test_the_magic_line_is_expanded_in_the_notebooks_namespace_as_ipython_does(kernel):
    """``{expr}``, ``$name`` and ``$$`` in ``%%distributed``'s line, at run time, as IPython expands any
    magic line; the awaiting cell's own locals (``line``, ``cell``) are not what ``{...}`` sees."""
    body = "import os, torch.distributed as dist\nprint('ws', dist.get_world_size(), os.environ['TAG'])"
    assert kernel.run("N = 2\ncell = 'not-this'\nTAG = 'tagged'").status == "ok"
    for line in ("-n {N} --env TAG={TAG}", "-n $N --env TAG=$TAG", "-n {N * 1} --env TAG={cell.upper()}"):
        res = kernel.run(f"%%distributed {line} --view text\n{body}")
        assert res.status == "ok", (line, res.error_text)
        want = "NOT-THIS" if "cell" in line else "tagged"
        assert f"[rank 1] ws 2 {want}" in res.stdout, (line, res.stdout)
    res = kernel.run(f"%%distributed -n $N --env TAG=a$$b --view text\n{body}")
    assert res.status == "ok" and "[rank 0] ws 2 a$b" in res.stdout, res.stdout + res.error_text
    # At run time: the value the name has when the cell runs.
    assert kernel.run("N = 3").status == "ok"
    res = kernel.run("%%distributed -n {N} --env TAG=x --view text\n" + body)
    assert res.status == "ok" and "[rank 2] ws 3 x" in res.stdout, res.stdout + res.error_text
    # A line that doesn't format is left as it is; the option's parse error names the text.
    res = kernel.run("%%distributed -n {not_defined_here} --view text\nprint(1)")
    assert res.status == "error" and res.error["ename"] == "UsageError", res.error_text
    assert "{not_defined_here}" in res.error["evalue"], res.error["evalue"]
    # The line magics are expanded by IPython itself: kept so.
    res = kernel.run("RUN = 'no-such-run-id'\n%dist_logs {RUN}")
    assert res.status == "error" and "no-such-run-id" in res.error["evalue"], res.error_text


@pytest.mark.parametrize(
    "line, message",
    [
        ("--nprocs 0", "--nprocs must be an int >= 1, got 0"),
        ("--nprocs two", "argument -n/--nprocs: invalid int value: 'two'"),
        ("--backend ncl", "--backend must be one of"),
        ("--timeout -1", "--timeout must be a positive number"),
        ("--env FOO", "--env takes KEY=VALUE pairs, got 'FOO'"),
        ("--pull 1x", "--pull takes comma-separated variable names"),
        ("--push not_defined_anywhere", "--push: no variable named 'not_defined_anywhere'"),
        ("--frobnicate", "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_options_are_one_clear_line(kernel, line, message):
    spawn_only(kernel)
    res = kernel.run(f"%%distributed {line}\nprint(1)")
    assert res.status == "error" and res.error["ename"] == "UsageError"
    assert message in res.error["evalue"] and "\n" not in res.error["evalue"].strip(), res.error["evalue"]
    assert not marked_pids()


def test_interrupt_stops_ranks_and_dataloader_workers_and_the_kernel_goes_on(kernel, tmp_path):
    kernel.run(f"READY = {str(tmp_path)!r}")
    msg_id = kernel.send("%%distributed -n 2\n" + LOADER_CELL)
    wait_for(lambda: len([f for f in os.listdir(tmp_path) if f.startswith("ready.")]) == 2, 90, what="ranks ready")
    assert len(marked_pids()) >= 6, "2 ranks and 4 DataLoader workers"
    t0 = time.monotonic()
    kernel.km.interrupt_kernel()
    res = kernel.collect(msg_id, timeout=30)
    elapsed = time.monotonic() - t0
    assert res.status == "error"
    assert res.error["ename"] == "RunStoppedError", res.error_text
    assert "interrupted: 2 ranks and 4 child processes stopped in" in res.error_text, res.error_text
    assert elapsed < 8
    assert not marked_pids()
    assert kernel.run("1 + 1").result == "2"
    assert kernel.run("_dist.status").result == "'interrupted'"


def test_kill_through_the_run_from_another_cell(kernel, tmp_path):
    kernel.run(f"READY = {str(tmp_path)!r}")
    assert kernel.run("%%distributed -n 2 --bg\n" + LOADER_CELL).status == "ok"
    wait_for(lambda: len([f for f in os.listdir(tmp_path) if f.startswith("ready.")]) == 2, 90, what="ranks ready")
    res = kernel.run("print(_dist.kill())")
    assert res.status == "ok" and "2 ranks and 4 child processes stopped" in res.stdout
    assert not marked_pids()


def test_dist_ps_and_dist_kill_find_a_dead_kernels_leftovers(kernel):
    spawn_only(kernel)
    import subprocess

    orphan = subprocess.Popen(["sleep", "60"], env=dict(os.environ, NBDIST_RUN_ID="20990101-000000-dead00"),
                              start_new_session=True)
    try:
        wait_for(lambda: marked_pids("20990101-000000-dead00"), 5, what="orphan")
        res = kernel.run("%dist_ps")
        assert "20990101-000000-dead00" in res.stdout and str(orphan.pid) in res.stdout
        assert any("Kill all" in str(d) or "application/vnd.jupyter.widget-view+json" in d for d in res.displays)
        res = kernel.run("%dist_kill 20990101-000000-dead00")
        assert "stopped 1 process" in res.stdout
        orphan.wait(timeout=5)
    finally:
        orphan.kill()
        orphan.wait()


@pytest.mark.parametrize("start", ["spawn", "warm"])
def test_kernel_sigkill_leaves_nothing_within_3_s(tmp_path, start):
    # Warm ranks are the template's children: they die with the kernel through the template.
    k = Kernel(env=dict(os.environ, OMP_NUM_THREADS="1", NBDIST_START_METHOD=start))
    try:
        k.run("%load_ext nbdist")
        k.run(f"READY = {str(tmp_path)!r}")
        k.send("%%distributed -n 2\n" + LOADER_CELL)
        wait_for(lambda: len([f for f in os.listdir(tmp_path) if f.startswith("ready.")]) == 2, 90, what="ranks")
        owned = marked_pids()
        assert len(owned) >= 6
        os.kill(k.pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: not marked_pids(), 3.0, what="ranks and grandchildren to die with the kernel")
        print(f"kernel SIGKILL -> nothing left in {time.monotonic() - t0:.2f} s")
    finally:
        k.kc.stop_channels()
        k.km.shutdown_kernel(now=True)


def test_launch_from_a_notebook_shows_the_notebook_source_line(kernel):
    kernel.run("import nbdist\ndef boom():\n    x = 1\n    raise KeyError('from the notebook')\n")
    res = kernel.run("nbdist.launch(boom, nprocs=2, init_process_group=False)")
    assert res.status == "error" and res.error["ename"] == "WorkerFailedError"
    assert "line 4, in boom" in res.error_text and "raise KeyError('from the notebook')" in res.error_text


def test_cell_under_mpirun(kernel):
    spawn_only(kernel)
    import shutil
    import sys

    if not (shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")):
        pytest.skip("mpiexec not installed")
    res = kernel.run("%%distributed -n 2 --launcher mpirun --view text\nimport torch.distributed as dist\n"
                     "print('mpi rank', dist.get_rank(), 'of', dist.get_world_size())\ndist.get_rank()")
    assert res.status == "ok", res.error_text + res.stdout
    assert "[rank 0] mpi rank 0 of 2" in res.stdout and "[rank 1] mpi rank 1 of 2" in res.stdout
    assert kernel.run("_dist.results").result == "{0: 0, 1: 1}"


@pytest.mark.parametrize("engine", ["torchrun", "srun"])
def test_cell_under_torchrun_and_srun(kernel, engine, request):
    spawn_only(kernel)
    extra = ""
    if engine == "srun":
        cluster = request.getfixturevalue("slurm_cluster")
        # The kernel was started before this test: point its srun at the test's Slurm.
        assert kernel.run(f"import os; os.environ['SLURM_CONF'] = {cluster.env['SLURM_CONF']!r}").status == "ok"
        extra = " --launcher-args '--overcommit'"
    res = kernel.run(f"%%distributed -n 2 --launcher {engine}{extra} --view text\nimport torch.distributed as dist\n"
                     "print('rank', dist.get_rank(), 'of', dist.get_world_size())\ndist.get_rank()")
    assert res.status == "ok", res.error_text + res.stdout
    assert "[rank 0] rank 0 of 2" in res.stdout and "[rank 1] rank 1 of 2" in res.stdout
    assert kernel.run("_dist.results").result == "{0: 0, 1: 1}"


def test_engine_options_are_checked_before_anything_starts(kernel):
    spawn_only(kernel)
    res = kernel.run("%%distributed -n 2 --nnodes 2\n1")
    assert res.status == "error" and "--nnodes, --node-rank and --master-port are for --launcher" in res.error_text
    res = kernel.run("%%distributed -n 2 --launcher torchrun --nnodes 2\n1")
    assert res.status == "error" and "nnodes=2 needs master_port=" in res.error_text
