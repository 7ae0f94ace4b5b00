"""The CUDA and NCCL paths, for real, on a machine with GPUs; skipped where CUDA is absent (CI).

``bash scripts/gpu-check.sh`` runs this file on a GPU machine that has PyTorch with CUDA and no
network. Each kernel here is a plain Python script (that machine has no IPython stack), so that the
kernel's own CUDA state (a context, a fork refusal) never touches the test process. Written for
one GPU and for several: ranks bind ``cuda:{local_rank % device_count}``; NCCL needs a GPU per
rank, so the tests of several NCCL ranks run where there are several GPUs.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest
from conftest import marked_pids, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))


def _gpus() -> int:
    """GPUs this machine has, counted without a CUDA context (NVML, or nvidia-smi)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch

        return torch.cuda.device_count() if torch.version.cuda else 0
    except Exception:
        return 0


GPUS = _gpus()
pytestmark = pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU here (scripts/gpu-check.sh runs these on one)")
several = pytest.mark.skipif(GPUS < 2, reason="needs two GPUs or more (NCCL wants a GPU per rank)")


def _memory_used() -> dict[int, int]:
    """MiB used on each GPU, as nvidia-smi says (no CUDA context here)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return {int(i): int(m) for i, m in (line.split(",") for line in out.strip().splitlines())}


def _back_to(baseline: dict[int, int], slack_mib: int = 64) -> bool:
    now = _memory_used()
    return all(now[i] <= baseline[i] + slack_mib for i in baseline)


def _kernel(run_script, body: str):
    """A kernel: a script that imports nbdist (and the tests' rank functions) and runs ``body``."""
    return run_script(f"import os, sys, time, torch, nbdist\nsys.path.insert(0, {HERE!r})\nimport rankfns\n{body}",
                      env={"OMP_NUM_THREADS": "1"})


# A kernel script's lines, in a session ``s``'s ``with`` block: rank 1 SIGKILLed, seen gone, healed.
_KILL_RANK_1_AND_HEAL = """    os.kill(s.pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while s.status != "degraded" and time.monotonic() < deadline:
        time.sleep(0.1)
    print("HEALED", s.heal())
"""


def _result(proc, timeout=180) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


# ---- one GPU -------------------------------------------------------------------------------------
def test_a_one_rank_nccl_run_binds_its_gpu(run_script):
    out = _result(_kernel(run_script, """
def on_gpu():
    import torch.distributed as dist
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    return (t.sum().item(), str(t.device), torch.cuda.current_device(), dist.get_backend())
print("AUTO", nbdist.launch(on_gpu, nprocs=1))
print("NCCL", nbdist.launch(on_gpu, nprocs=1, backend="nccl"))
print("SHARED", nbdist.launch(on_gpu, nprocs=GPUS + 1))
print("CUDA IN KERNEL", torch.cuda.is_initialized())
""".replace("GPUS", str(GPUS))))
    assert "AUTO {0: (4.0, 'cuda:0', 0, 'nccl')}" in out, out  # auto is nccl where CUDA is
    assert "NCCL {0: (4.0, 'cuda:0', 0, 'nccl')}" in out and "CUDA IN KERNEL False" in out, out
    # More ranks than GPUs: NCCL would refuse the shared GPU; auto is gloo, on CUDA tensors
    shared = eval(out.split("SHARED ", 1)[1].splitlines()[0])
    assert {v[0] for v in shared.values()} == {4.0 * (GPUS + 1)} and {v[3] for v in shared.values()} == {"gloo"}, out
    assert shared[GPUS][1] == "cuda:0", out  # cuda:{local_rank % device_count}


def test_two_ranks_with_gloo_on_cuda_tensors_share_the_gpus(run_script):
    out = _result(_kernel(run_script, """
def gloo_on_gpu():
    import torch.distributed as dist
    t = torch.ones(8, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return (t[0].item(), torch.cuda.current_device())
print("RESULT", nbdist.launch(gloo_on_gpu, nprocs=2, backend="gloo"))
"""))
    assert f"RESULT {{0: (3.0, 0), 1: (3.0, {1 % GPUS})}}" in out, out  # cuda:{local_rank % device_count}


def test_a_one_rank_nccl_session_keeps_state_stops_and_re_forms_its_nccl_group(run_script):
    """The re-formable group over real NCCL: a loop of GPU all_reduces stopped anywhere goes back to
    idle with its state; the inner NCCL group is released (aborted) and connected anew, and cut
    (aborted from another thread) and connected anew, while the group object stays the same."""
    out = _result(_kernel(run_script, """
with nbdist.Session(nprocs=1, backend="nccl") as s:
    s.wait_ready(120)
    print("BACKEND", s.execute("import torch, torch.distributed as dist\\nt = torch.ones(2, device='cuda')\\n"
                               "dist.all_reduce(t)\\ng = dist.distributed_c10d._get_default_group()\\n"
                               "(dist.get_backend(), type(g).__name__, t.sum().item())"))
    cell = s.execute("n = 0\\nwhile True:\\n    dist.all_reduce(t)\\n    torch.cuda.synchronize()\\n    n += 1",
                     join=False)
    time.sleep(2)
    cell.interrupt()
    try:
        cell.wait(30)
    except nbdist.RunStoppedError as e:
        print("STOPPED", "idle again, their state kept" in str(e))
    print("KEPT", s.execute("n > 0"))
    print("REFORMED", s.execute("from nbdist.worker import reformable_groups as rg\\n"
                                "rg.release_groups()\\nrg.reform_groups(7)\\nu = torch.ones(3, device='cuda')\\n"
                                "dist.all_reduce(u)\\n(u.sum().item(), g is dist.distributed_c10d._get_default_group())"))
    print("CUT", s.execute("rg.cut_groups()\\nrg.reform_groups(8)\\nv = torch.ones(5, device='cuda')\\n"
                           "dist.all_reduce(v)\\nv.sum().item()"))
    print("STATUS", s.status)
    # No device bound to the default group: a DeviceMesh's groups are then made by new_group, which a
    # heal replays (with a bound device torch makes them by split_group, which it can't).
    print("UNBOUND", s.execute("dist.distributed_c10d._get_default_group().bound_device_id is None"))
"""))
    assert "BACKEND {0: ('nccl', 'ReformableGroup', 2.0)}" in out and "UNBOUND {0: True}" in out, out
    assert "STOPPED True" in out and "KEPT {0: True}" in out, out
    assert "REFORMED {0: (3.0, True)}" in out and "CUT {0: 5.0}" in out and "STATUS idle" in out, out


def test_torch_s_nccl_flight_recorder_says_what_the_gpu_waits_in(run_script):
    """An NCCL all_reduce queued behind a long GPU kernel: Python's call has returned (torch gives
    no work for a synchronous NCCL collective), so only the GPU still has it. The rank's report
    (``Session.collectives()``, %dist_stacks, the stop message) carries torch's own Flight
    Recorder's words for it: scheduled on the GPU. (One GPU: NCCL takes a GPU per rank, so no hang
    between two NCCL ranks here.)"""
    out = _result(_kernel(run_script, """
with nbdist.Session(nprocs=1, backend="nccl") as s:
    s.wait_ready(120)
    s.execute("import torch, torch.distributed as dist\\nt = torch.ones(1024, device='cuda')\\n"
              "dist.all_reduce(t)\\ntorch.cuda.synchronize()")
    cell = s.execute("torch.cuda._sleep(4_000_000_000)\\ndist.all_reduce(t)\\ntorch.cuda.synchronize()", join=False)
    time.sleep(0.5)
    report = s.collectives()[0]
    print("OURS", report["open"], report["last"][-1:])
    print("TORCH", report["torch"])
    from nbdist.session.collectives import describe_open_collectives
    print("SAID", describe_open_collectives({0: report}))
    cell.wait(60)
    cell = s.execute("torch.cuda._sleep(4_000_000_000)\\ndist.all_reduce(t)\\ntorch.cuda.synchronize()", join=False)
    time.sleep(0.5)
    cell.interrupt()
    try:
        cell.wait(60)
    except nbdist.RunStoppedError as e:
        print("STOPPED", str(e).replace(chr(10), " "))
    print("AFTER", s.execute("u = torch.ones(2, device='cuda')\\ndist.all_reduce(u)\\nu.sum().item()"))
"""))
    print(out)  # the words, for the check's log
    stopped = next(line for line in out.splitlines() if line.startswith("STOPPED"))
    assert "where each rank waited: rank 0: on the GPU, nccl:all_reduce #" in stopped, out
    torch_line = next(line for line in out.splitlines() if line.startswith("TORCH"))
    assert "nccl:all_reduce #" in torch_line and " float32[1024] on pg " in torch_line, out
    assert "scheduled on the GPU" in torch_line or "running on the GPU" in torch_line, out
    said = next(line for line in out.splitlines() if line.startswith("SAID"))
    assert said.startswith("SAID rank 0: on the GPU, nccl:all_reduce #") and "(torch's NCCL flight recorder)" in said, out
    assert "OURS [] ['all_reduce #2 float32[1024] on the default group (issued)']" in out, out  # no work: issued
    assert "AFTER {0: 2.0}" in out, out


def test_warm_ranks_start_and_use_cuda_while_the_kernel_holds_a_context(run_script):
    out = _result(_kernel(run_script, """
nbdist.warm(wait=True)
held = torch.ones(1024, 1024, device="cuda")  # the kernel's own CUDA context, as a notebook's model
def on_gpu():
    import torch.distributed as dist
    t = torch.ones(2, device="cuda")
    dist.all_reduce(t)
    return t.sum().item()
run = nbdist.launch(on_gpu, nprocs=1, join=False)
print("RESULT", run.wait(120), run.launcher.start_method)
from nbdist.warmstart.handle import current_template
print("TEMPLATE", current_template().status)
"""))
    assert "RESULT {0: 2.0} warm" in out and "TEMPLATE ready" in out, out


def test_fork_after_the_kernel_initialised_cuda_is_refused_naming_where(run_script):
    out = _result(_kernel(run_script, """
nbdist.launch(rankfns.takes_anything, nprocs=1, init_process_group=False)  # nbdist watches CUDA from here
model = torch.nn.Linear(4, 4).cuda()  # LINE OF THE FIRST CUDA USE
try:
    nbdist.launch(rankfns.takes_anything, nprocs=1, start_method="fork", init_process_group=False)
except nbdist.LaunchConfigError as e:
    print("REFUSED", e)
"""))
    refused = next(line for line in out.splitlines() if line.startswith("REFUSED"))
    assert "CUDA is already initialised in this kernel (first by" in refused, refused
    assert "model = torch.nn.Linear(4, 4).cuda()" in refused and "start_method='warm'" in refused, refused


def test_fork_follows_the_cuda_driver_not_only_torchs_context(run_script):
    """``torch.cuda.is_available()`` with the NVML-based check leaves the driver alone: fork works.
    Without it, the check initialises the driver (cuInit) while ``torch.cuda.is_initialized()`` stays
    False, and forked ranks could not use CUDA: refused, saying why."""
    out = _result(_kernel(run_script, """
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
print("NVML", torch.cuda.is_available(), torch.cuda.is_initialized())
print("FORKED", nbdist.launch(rankfns.takes_anything, nprocs=1, start_method="fork", init_process_group=False))
del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
print("DRIVER", torch.cuda.is_available(), torch.cuda.is_initialized())
try:
    nbdist.launch(rankfns.takes_anything, nprocs=1, start_method="fork", init_process_group=False)
except nbdist.LaunchConfigError as e:
    print("REFUSED", e)
"""))
    assert "NVML True False" in out and "FORKED {0: " in out and "DRIVER True False" in out, out
    assert "REFUSED CUDA is already initialised in this kernel (its driver initialised by" in out, out


@pytest.mark.parametrize("how", ["kill", "session stop", "kernel SIGKILL"])
def test_gpu_memory_is_given_back(run_script, how):
    """A run killed, a session stopped, a kernel SIGKILLed: the GPU memory their ranks held is free
    again within seconds (what users fear first: orphans holding their GPUs)."""
    baseline = _memory_used()
    if how == "kill":
        body = """
run = nbdist.launch(rankfns.hold_gpu_memory, 1024, nprocs=1, join=False)
while not os.path.exists(os.path.join(run.run_dir, "holding")):
    time.sleep(0.1)
print("HOLDING", run.run_id, flush=True)
sys.stdin.readline()
run.kill()
print("KILLED", run.status, flush=True)
"""
    else:
        body = """
s = nbdist.Session(nprocs=1)
s.wait_ready(120)
s.execute("import torch\\nblock = torch.empty(1024 * 2**20, dtype=torch.uint8, device='cuda')\\n"
          "torch.cuda.synchronize()")
print("HOLDING", s.session_id, flush=True)
sys.stdin.readline()
s.close()
print("CLOSED", s.status, flush=True)
"""
    proc = run_script(f"import os, sys, time, nbdist\nsys.path.insert(0, {HERE!r})\nimport rankfns\n{body}",
                      stdin=subprocess.PIPE)
    marker = proc.stdout.readline().split()[1]
    wait_for(lambda: not _back_to(baseline, slack_mib=512), 30, what="the rank to hold its 1 GiB")
    t0 = time.monotonic()
    if how == "kernel SIGKILL":
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    else:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().split()[0] in ("KILLED", "CLOSED")
        proc.wait(30)
    wait_for(lambda: not marked_pids(marker), 5, what="the ranks to go")
    wait_for(lambda: _back_to(baseline), 10, what="the GPU memory to be free again")
    print(f"{how}: GPU memory back to its baseline in {time.monotonic() - t0:.2f} s")


# ---- several GPUs --------------------------------------------------------------------------------
@several
def test_ddp_on_nccl_across_gpus_trains_on_after_a_stop_mid_step(run_script):
    n = min(GPUS, 4)
    out = _result(_kernel(run_script, f"""
with nbdist.Session(nprocs={n}, backend="nccl") as s:
    s.wait_ready(180)
    s.execute('''
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(256, 1).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(512, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(dist.get_rank()))
def step():
    opt.zero_grad()
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.item()
''')
    before = s.execute("step()")[0]
    said = ""
    for delay in (0.5, 1.0, 1.5):
        cell = s.execute("while True:\\n    step()", join=False)
        time.sleep(delay)
        cell.interrupt()
        try:
            cell.wait(60)
        except nbdist.RunStoppedError as e:
            said += str(e)
    if "now differ between ranks" in said:
        s.execute("for p in model.parameters():\\n    dist.broadcast(p.data, src=0)")
    after = s.execute("[step() for _ in range(10)][-1]", timeout=120)[0]
    sums = s.execute("round(sum(p.sum().item() for p in model.parameters()), 4)")
    print("TRAINED", after < before, len(set(sums.values())) == 1, s.status)
"""), timeout=400)
    assert "TRAINED True True idle" in out, out


@several
def test_a_rank_that_raises_while_its_peers_wait_in_nccl_is_released(run_script):
    """The stuck peer waits in a CUDA sync on an NCCL all_reduce: its communicator is aborted, the
    group re-formed in place, and the error shows in seconds, the session idle."""
    out = _result(_kernel(run_script, """
with nbdist.Session(nprocs=2, backend="nccl") as s:
    s.wait_ready(180)
    s.execute("import torch, torch.distributed as dist\\nkept = dist.get_rank()")
    t0 = time.monotonic()
    try:
        s.execute("import time\\nt = torch.ones(1 << 20, device='cuda')\\nif dist.get_rank() == 1:\\n    time.sleep(0.5)\\n"
                  "    raise ValueError('bad shard')\\ndist.all_reduce(t)\\ntorch.cuda.synchronize()", timeout=60)
    except nbdist.WorkerFailedError as e:
        print("FAILED", e.rank, "re-formed in place" in str(e), round(time.monotonic() - t0, 2))
    print("AFTER", s.execute("u = torch.ones(2, device='cuda')\\ndist.all_reduce(u)\\n(u.sum().item(), kept)"))
"""), timeout=300)
    assert "FAILED 1 True" in out and "AFTER {0: (4.0, 0), 1: (4.0, 1)}" in out, out


def test_nvidia_smi_is_there():
    assert shutil.which("nvidia-smi"), "the GPU checks read GPU memory with nvidia-smi"


def test_gloo_session_ranks_share_one_gpu_and_a_healed_rank_gets_the_donors_cuda_state(run_script):
    """Issue 28 on one GPU. Several ranks on one GPU can't use NCCL (it wants a GPU each), so a gloo
    session's groups take CUDA tensors, as torch's own gloo group does (they once took CPU tensors
    only). Rank 1 dies; the heal copies the survivors' DDP model, Adam state and tensor through the
    host onto the new rank's device, and the three ranks train on in step."""
    out = _result(_kernel(run_script, """
import signal
with nbdist.Session(nprocs=3, backend="gloo") as s:
    s.wait_ready(180)
    s.execute('''
import torch, torch.distributed as dist
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 1).cuda())
opt = torch.optim.Adam(model.parameters(), lr=0.01)
def step():
    model(torch.ones(4, 64, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
    return round(sum(p.sum().item() for p in model.parameters()), 6)
step()
w = torch.arange(8., device="cuda")
''')
""" + _KILL_RANK_1_AND_HEAL + """    print("DEVICES", s.execute("p = next(model.parameters())\\n"
                               "(str(w.device), str(p.device), str(opt.state[p]['exp_avg'].device), model.device_ids, "
                               "str(model.device))"))
    print("STEPS", s.execute("[step() for _ in range(3)]"))
    print("SUM", s.execute("t = w.clone()\\ndist.all_reduce(t)\\nt.sum().item()"))
"""), timeout=400)
    here = 1 % GPUS  # cuda:{local_rank % device_count}
    # DDP without device_ids keeps None there; its device (Join's flags) is the new rank's own
    assert f"1: ('cuda:{here}', 'cuda:{here}', 'cuda:{here}', None, 'cuda:{here}')" in out, out
    steps = eval(out.split("STEPS ", 1)[1].splitlines()[0])
    assert len(set(map(tuple, steps.values()))) == 1 and len(steps) == 3, out
    assert "SUM {0: 84.0, 1: 84.0, 2: 84.0}" in out, out


@several
def test_a_healed_rank_gets_the_donors_cuda_tensors_on_its_own_device(run_script):
    """Issue 28 on GPUs: rank 1 (cuda:1) dies; the heal copies rank 0's DDP model and Adam state (one
    survivor: what nbdist knows is replicated), and they arrive on cuda:1, where the new rank's NCCL
    collectives then run with its peers."""
    out = _result(_kernel(run_script, """
import signal
with nbdist.Session(nprocs=2, backend="nccl") as s:
    s.wait_ready(180)
    s.execute('''
import torch, torch.distributed as dist
torch.manual_seed(0)
here = torch.cuda.current_device()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 1).cuda(), device_ids=[here])
opt = torch.optim.Adam(model.parameters(), lr=0.01)
model(torch.ones(4, 64, device="cuda")).sum().backward()
opt.step()
''')
""" + _KILL_RANK_1_AND_HEAL + """    print("DEVICES", s.execute("p = next(model.parameters())\\n"
                               "(str(p.device), str(opt.state[p]['exp_avg'].device), model.device_ids, str(model.device))"))
    print("SUM", s.execute("t = torch.ones(8, device='cuda')\\ndist.all_reduce(t)\\n"
                           "model(torch.ones(4, 64, device='cuda')).sum().backward()\\nt.sum().item()"))
"""), timeout=400)
    assert "DEVICES {0: ('cuda:0', 'cuda:0', [0], 'cuda:0'), 1: ('cuda:1', 'cuda:1', [1], 'cuda:1')}" in out, out
    assert "SUM {0: 16.0, 1: 16.0}" in out, out
