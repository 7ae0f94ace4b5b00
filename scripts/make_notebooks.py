"""Write the notebooks in notebooks/ (docs that CI executes). Edit here, then run:

    .venv/bin/python scripts/make_notebooks.py
"""

import os

import nbformat as nbf

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "notebooks")
md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell


def raises(source):
    """A cell that fails on purpose: nbclient lets it, and the notebook goes on."""
    cell = code(source)
    cell.metadata["tags"] = ["raises-exception"]
    return cell


def write(name, cells):
    nb = nbf.v4.new_notebook()
    nb.cells = cells
    for i, cell in enumerate(cells):  # stable ids: regenerating must not churn the files
        cell["id"] = f"{os.path.splitext(name)[0][:2]}-{i:02d}"
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbf.write(nb, os.path.join(HERE, name))


write("01_quickstart.ipynb", [
    md("# nbdist quickstart: DDP on 4 ranks from a notebook cell\n\n"
       "`%%distributed` runs a cell on N PyTorch ranks (4 CPU ranks with gloo here; on a GPU machine, one per GPU "
       "with NCCL). Each rank's output streams into its own tab; the cell's result is rank 0's last expression."),
    code("%load_ext nbdist"),
    md("A model and a data generator defined in the notebook. They travel to the ranks by value, so nothing "
       "needs to live in a module."),
    code("import torch\nimport torch.nn as nn\n\n"
         "class TinyNet(nn.Module):\n"
         "    def __init__(self):\n"
         "        super().__init__()\n"
         "        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))\n\n"
         "    def forward(self, x):\n"
         "        return self.body(x)\n\n"
         "def make_batch(generator, true_w, batch=64):\n"
         "    x = torch.randn(batch, 16, generator=generator)\n"
         "    return x, x @ true_w + 0.01 * torch.randn(batch, 1, generator=generator)\n\n"
         "STEPS = 80"),
    md("Train with DDP. Each rank draws its own shard of synthetic data; gradients are averaged across ranks. "
       "Rank 0 shows a tqdm bar (one updating line), and `--pull losses` brings rank 0's loss curve back."),
    code("%%distributed --nprocs 4 --pull losses\n"
         "import torch, torch.distributed as dist\n"
         "from torch.nn.parallel import DistributedDataParallel as DDP\n"
         "from tqdm import tqdm\n\n"
         "torch.manual_seed(0)\n"
         "true_w = torch.randn(16, 1)\n"
         "g = torch.Generator().manual_seed(1000 + dist.get_rank())\n"
         "model = DDP(TinyNet())\n"
         "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
         "losses = []\n"
         "steps = range(STEPS)\n"
         "for step in (tqdm(steps, desc='training', mininterval=0.2) if dist.get_rank() == 0 else steps):\n"
         "    x, y = make_batch(g, true_w)\n"
         "    loss = nn.functional.mse_loss(model(x), y)\n"
         "    opt.zero_grad()\n"
         "    loss.backward()\n"
         "    opt.step()\n"
         "    t = loss.detach().clone()\n"
         "    dist.all_reduce(t)\n"
         "    losses.append(t.item() / dist.get_world_size())\n"
         "print(f'rank {dist.get_rank()}: final loss {losses[-1]:.4f}')\n"
         "round(losses[-1], 4)"),
    md("`losses` is now a notebook variable, and `_dist` is the run (its results, logs and status)."),
    code("import matplotlib\nmatplotlib.use('agg')\nimport matplotlib.pyplot as plt\n%matplotlib inline\n\n"
         "fig, ax = plt.subplots(figsize=(6, 3))\n"
         "ax.plot(losses)\n"
         "ax.set_xlabel('step'); ax.set_ylabel('mean loss over 4 ranks'); ax.set_yscale('log')\n"
         "ax.set_title('DDP on 4 CPU ranks')\n"
         "plt.show()\n"
         "print(_dist.status, _dist.results, _dist.run_dir)"),
    md("Nothing is left running: `%dist_ps` lists leftover ranks of any run, even of a dead kernel. The "
       "kernel's warm template stays, listed below the table: it forks the next cell's ranks in milliseconds, "
       "and it ends with the kernel."),
    code("%dist_ps"),
])

write("02_failures_and_interrupts.ipynb", [
    md("# When things go wrong\n\n"
       "A failing rank, a hang, and processes left behind: what nbdist shows, and how nothing keeps running."),
    code("%load_ext nbdist"),
    md("## A failing rank\n\nRank 1 raises while rank 0 waits in a collective. The others are stopped at once "
       "(no waiting for a collective's timeout), and the cell ends with the root cause: the first rank to fail, its "
       "pid and exit code, and the traceback in this cell's own line numbers."),
    raises("%%distributed --nprocs 2\n"
           "import torch.distributed as dist\n"
           "def load_shard(rank):\n"
           "    if rank == 1:\n"
           "        raise FileNotFoundError(f'shard-{rank}.pt')\n"
           "load_shard(dist.get_rank())\n"
           "dist.barrier()"),
    code("err = _dist.error\nprint(err.rank, err.failures[err.rank].exc_type, err.failures[err.rank].exitcode)"),
    md("## A hang, stopped by `--timeout`\n\nWhen the timeout expires every rank's Python stack is dumped into its log "
       "(faulthandler), then the run is stopped."),
    raises("%%distributed --nprocs 2 --timeout 6\n"
           "import time\n"
           "def wait_for_a_message_that_never_comes():\n"
           "    time.sleep(600)\n"
           "wait_for_a_message_that_never_comes()"),
    code("%dist_logs 0"),
    md("## Leftovers: `%dist_ps` and Kill\n\n`--bg` returns at once. `%dist_ps` lists every live process that "
       "carries a run's marker (also those of a kernel that died), with a Kill-all button; `_dist.kill()` or "
       "`%dist_kill` do the same from code."),
    code("%%distributed --nprocs 2 --bg\nimport time\ntime.sleep(600)"),
    code("import time\nwhile len(__import__('nbdist').ps(_dist.run_id)) < 2:\n    time.sleep(0.2)\n%dist_ps"),
    code("print(_dist.kill())\n%dist_ps"),
])

write("03_launch_api.ipynb", [
    md("# `nbdist.launch`: the engine from code\n\nThe same engine as `%%distributed`, for a plain function. "
       "Lambdas, closures and functions or classes defined in the notebook travel by value."),
    code("import nbdist, torch, torch.distributed as dist\n\n"
         "def total(x):\n"
         "    t = torch.tensor([x * (dist.get_rank() + 1)])\n"
         "    dist.all_reduce(t)\n"
         "    return t.item()\n\n"
         "nbdist.launch(total, 1.0, nprocs=4)"),
    md("`join=False` returns a `Run` at once: the kernel stays free while the ranks work."),
    code("import time\n\n"
         "def slow_square(x):\n"
         "    time.sleep(1)\n"
         "    return (nbdist.rank(), x * x)\n\n"
         "run = nbdist.launch(slow_square, 7, nprocs=3, join=False, init_process_group=False)\n"
         "print(run.status, run.nprocs, sorted(run.pids))"),
    code("run.wait()"),
    code("print(run.status, run.results)\nprint(open(f'{run.run_dir}/rank0.stdout').read() or '(rank 0 printed nothing)')"),
    md("A failure raises `WorkerFailedError`; the ranks that finished keep their results."),
    code("def picky():\n"
         "    if nbdist.rank() == 1:\n"
         "        time.sleep(0.5)\n"
         "        raise ValueError('rank 1 disagrees')\n"
         "    return 'ok'\n\n"
         "try:\n"
         "    nbdist.launch(picky, nprocs=2, init_process_group=False)\n"
         "except nbdist.WorkerFailedError as err:\n"
         "    print('first to fail:', err.rank)\n"
         "    print('results kept:', err.results)"),
    code("nbdist.ps()"),
])

write("04_multinode.ipynb", [
    md("# Beyond one machine: attach, torchrun, MPI, Slurm\n\n"
       "nbdist never runs a cluster manager of its own. On a cluster, the engines the cluster already has start the "
       "processes, and nbdist runs *inside* them.\n\n"
       "**Attach.** A kernel (or script) that already is a rank of a torchrun, MPI or Slurm world runs "
       "`nbdist.launch(fn)` and `%%distributed` in place, as its rank: no new process, and every rank gets the "
       "gathered `{rank: value}` dict. Under MPI, rank and size come from mpi4py, rank 0 hosts the rendezvous store "
       "and broadcasts its address, and `local_rank` comes from a shared-memory split of COMM_WORLD (so it is right "
       "on several nodes). A world of one does not attach: it spawns."),
    code("import nbdist\nfrom nbdist.protocol.world import detect_world\nprint('this kernel:', detect_world())"),
    md("Below, a script that calls `nbdist.launch(fn)` runs under real engines on this machine."),
    code("%%writefile attach_demo.py\n"
         "import os, nbdist, torch, torch.distributed as dist\n\n"
         "def where():\n"
         "    t = torch.ones(1)\n"
         "    dist.all_reduce(t)\n"
         "    return (int(os.environ['LOCAL_RANK']), t.item())\n\n"
         "if __name__ == '__main__':\n"
         "    results = nbdist.launch(where)\n"
         "    if nbdist.rank() == 0:\n"
         "        print('world of', len(results), results, flush=True)"),
    md("Under `mpiexec` (pip's `mpich`; install with `pip install 'nbdist[mpi]'`):"),
    code("import os, subprocess, sys\n"
         "bindir = os.path.dirname(sys.executable)\n"
         "env = dict(os.environ, OMP_NUM_THREADS='1')\n"
         "out = subprocess.run([os.path.join(bindir, 'mpiexec'), '-n', '4', sys.executable, 'attach_demo.py'],\n"
         "                     capture_output=True, text=True, env=env, timeout=300)\n"
         "print(out.stdout)"),
    md("Under `torchrun` (here `--standalone`; across nodes, `--nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT`):"),
    code("out = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '2',\n"
         "                      'attach_demo.py'], capture_output=True, text=True, env=env, timeout=300)\n"
         "print(out.stdout)"),
    md("## Kernels on several nodes\n\n"
       "Start one kernel per node under the engine, for example one ipyparallel MPI engine per node "
       "(`ipcluster start -n 4 --engines=mpi`), a kernel per task of `srun -n 2`, or one per torchrun agent. "
       "`%%distributed` without `--nprocs` runs the cell in place, as that rank. With `--nprocs N`, each kernel "
       "spawns N ranks of one bigger world instead: global rank = kernel rank x N + local rank, and kernel 0 hosts "
       "the store and broadcasts where it is.\n\n"
       "## Launchers: the engine starts the ranks\n\n"
       "`launcher='torchrun' | 'mpirun' | 'srun'` (and `%%distributed --launcher ...`) run "
       "`python -m nbdist.worker RUN_DIR` under the engine: the same results, errors, view and teardown as spawn "
       "(a stop takes the engine's whole session and every process with the run's marker; the engine dies with "
       "the kernel). On a cluster, put the run dir on a shared path (`run_dir=`, `--run-dir`, `NBDIST_RUN_DIR`); "
       "ranks on other machines stream their output back to the kernel over an authenticated channel."),
    code("def rank_and_size():\n"
         "    import torch.distributed as dist\n"
         "    return (dist.get_rank(), dist.get_world_size())\n\n"
         "print(nbdist.launch(rank_and_size, nprocs=4, launcher='mpirun'))\n"
         "print(nbdist.launch(rank_and_size, nprocs=4, launcher='torchrun'))"),
    md("**Two torchrun nodes.** Each node's kernel calls `launch(..., launcher='torchrun', nnodes=2, node_rank=k, "
       "master_addr=NODE0, master_port=P)`; c10d joins them into one world, and node k's ranks are "
       "`k * nprocs + local_rank`. Here node 1 is a script started from this notebook, on the same machine:"),
    code("%%writefile node1.py\n"
         "import sys, nbdist\n\n"
         "def rank_and_size():\n"
         "    import torch.distributed as dist\n"
         "    return (dist.get_rank(), dist.get_world_size())\n\n"
         "if __name__ == '__main__':\n"
         "    print(nbdist.launch(rank_and_size, nprocs=2, launcher='torchrun', nnodes=2, node_rank=1,\n"
         "                        master_addr='127.0.0.1', master_port=int(sys.argv[1])))"),
    code("import socket\n"
         "with socket.socket() as s:\n"
         "    s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]\n"
         "node1 = subprocess.Popen([sys.executable, 'node1.py', str(port)], stdout=subprocess.PIPE, text=True, env=env)\n"
         "print('node 0:', nbdist.launch(rank_and_size, nprocs=2, launcher='torchrun', nnodes=2, node_rank=0,\n"
         "                               master_addr='127.0.0.1', master_port=port))\n"
         "print('node 1:', node1.communicate(timeout=120)[0].strip())"),
    md("With Slurm: `nbdist.launch(fn, nprocs=8, launcher='srun', nnodes=2, run_dir='/shared/runs')` inside an "
       "allocation, or `%%distributed --launcher srun -n 8 --nnodes 2 --run-dir /shared/runs`."),
    code("os.remove('attach_demo.py'); os.remove('node1.py')"),
])

write("05_sessions.ipynb", [
    md("# Sessions: ranks that live across cells\n\n"
       "`%dist_start` starts ranks that stay alive between cells, each with its namespace and its process group. "
       "Build a model once, train it over several cells, stop it, look inside, train more, save a checkpoint: "
       "the model, the optimizer and the data stay on the ranks the whole time."),
    code("%load_ext nbdist"),
    code("%dist_start -n 2"),
    md("A DDP model on 2 CPU ranks (gloo). Everything this cell defines stays on the ranks."),
    code("%%distributed\n"
         "import torch, torch.distributed as dist\n"
         "from torch.nn.parallel import DistributedDataParallel as DDP\n"
         "torch.manual_seed(0)\n"
         "model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))\n"
         "opt = torch.optim.Adam(model.parameters(), lr=1e-2)\n"
         "X = torch.randn(256, 8, generator=torch.Generator().manual_seed(dist.get_rank()))\n"
         "Y = X.sum(1, keepdim=True)\n"
         "losses = []\n\n"
         "def train(steps):\n"
         "    for _ in range(steps):\n"
         "        opt.zero_grad()\n"
         "        loss = ((model(X) - Y) ** 2).mean()\n"
         "        loss.backward()\n"
         "        opt.step()\n"
         "        losses.append(loss.item())\n"
         "    return losses[-1]\n\n"
         "print(f'rank {dist.get_rank()}: model built')"),
    md("Train, in a cell of its own. Rank 0's last expression is the cell's value."),
    code("%%distributed\ntrain(40)"),
    md("A training loop that would run for ever, stopped: the stop button does the same as `--timeout` here "
       "(which a headless run can't press). The ranks go back to idle, and the model keeps its weights."),
    raises("%%distributed --timeout 3\nwhile True:\n    train(1)"),
    md("Look inside: how far training got, on every rank, and each rank's stack right now."),
    code("%%distributed\nprint(f'rank {dist.get_rank()}: {len(losses)} steps, loss {losses[-1]:.4f}')\nlen(losses)"),
    code("%dist_stacks"),
    md("A rank fails in the middle of training while its peer waits for it in DDP's gradient all-reduce. "
       "The error (rank 1's own line) comes at once; the peer is released, the process group is re-formed "
       "*in place* (the DDP model still holds it), and every rank is idle again with its state."),
    raises("%%distributed\nimport time\nfor step in range(10**6):\n    if step == 5 and dist.get_rank() == 1:\n"
           "        time.sleep(0.5)  # a slow read of a corrupt shard\n"
           "        raise RuntimeError('corrupt shard on rank 1')\n    train(1)"),
    md("Train more: the same model, the same optimizer state."),
    code("%%distributed\nround(train(40), 4)"),
    md("FSDP2 (`fully_shard`) works the same way on CPU ranks; its sharded state is saved with "
       "`torch.distributed.checkpoint`, one file per rank. `ckpt` is a notebook variable: it travels to the ranks."),
    code("import tempfile\nckpt = tempfile.mkdtemp(prefix='nbdist-ckpt-')"),
    code("%%distributed\n"
         "from torch.distributed.fsdp import fully_shard\n"
         "import torch.distributed.checkpoint as dcp\n"
         "torch.manual_seed(0)\n"
         "net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))\n"
         "for layer in net:\n"
         "    if isinstance(layer, torch.nn.Linear):\n"
         "        fully_shard(layer)\n"
         "fully_shard(net)\n"
         "fsdp_opt = torch.optim.Adam(net.parameters(), lr=1e-2)\n\n"
         "def train_fsdp(steps):\n"
         "    for _ in range(steps):\n"
         "        fsdp_opt.zero_grad()\n"
         "        fsdp_loss = ((net(X) - Y) ** 2).mean()\n"
         "        fsdp_loss.backward()\n"
         "        fsdp_opt.step()\n"
         "    return round(fsdp_loss.item(), 4)\n\n"
         "train_fsdp(30)"),
    md("Stopped in the middle of its loop, the sharded model trains on, and its checkpoint is saved."),
    raises("%%distributed --timeout 2\nwhile True:\n    train_fsdp(1)"),
    code("%%distributed\n"
         "loss = train_fsdp(30)\n"
         "dcp.save({'model': net.state_dict()}, checkpoint_id=ckpt)\n"
         "loss"),
    code("import os\nsorted(os.listdir(ckpt))"),
    md("Stop the session: nothing of it is left running (the warm template stays, ready for the next start)."),
    code("%dist_stop"),
    code("%dist_ps"),
])

write("06_debugging.ipynb", [
    md("# Debugging the ranks: which collective each rank is in, checked collectives, and pdb\n\n"
       "A session's ranks keep a flight recorder of their collectives, can check that they all call the same "
       "one, and stop in pdb with the prompt in the notebook. This notebook runs headless in CI: the recorder "
       "and the checks execute; the debugger's cells show their commands (a headless run has no stdin, so a "
       "breakpoint there says so in one line and the cell goes on)."),
    code("%load_ext nbdist"),
    code("%dist_start -n 2"),
    code("%%distributed\nimport time, torch, torch.distributed as dist\nrank = dist.get_rank()\n"
         "dist.all_reduce(torch.ones(4))\ndist.broadcast(torch.zeros(2, 3), src=0)"),
    md("## The flight recorder\n\nEach rank keeps its last 64 collectives per group: op, sequence number, shapes and "
       "dtypes, root, start, end and state. With NCCL, a collective returns to Python once it is queued on the GPU: "
       "the reports then add what torch's own Flight Recorder says of the ones the GPU has not finished (\"on the "
       "GPU, nccl:all_reduce #3 float32[1024] on pg 0, scheduled on the GPU 1.0 s ago\")."),
    code("%%distributed\nfrom nbdist.worker.flight_recorder import recent_collectives, describe_collective\n"
         "for c in recent_collectives():\n    print(describe_collective(c), '->', c.state)"),
    md("A hang: rank 0 all-reduces while rank 1 broadcasts. The stop button (here `--timeout`, which a headless "
       "run can press) frees both, re-forms the group in place, and the message says where each rank waited."),
    raises("%%distributed --timeout 3\nif rank == 0:\n    dist.all_reduce(torch.ones(3))\n"
           "else:\n    dist.broadcast(torch.ones(3), src=1)\n    time.sleep(60)"),
    md("The ranks are idle again, in step, their state kept:"),
    code("%%distributed\nx = torch.ones(2)\ndist.all_reduce(x)\nx.tolist()"),
    md("`%dist_stacks` shows each rank's open collective beside its stack; here a cell runs in the background "
       "(`--bg`) while rank 0 waits in a barrier that rank 1 never joins."),
    code("%%distributed --bg\nif rank == 0:\n    dist.barrier()\nelse:\n    time.sleep(60)"),
    code("import time\ntime.sleep(1.5)\n%dist_stacks"),
    code("_dist.interrupt()"),
    md("## Checked collectives\n\n`--check-collectives` (or `%dist_start --check-collectives` for every cell) makes the "
       "ranks compare each collective before they issue it: a mismatch is an error at once, naming each rank's "
       "call, and no rank issued it."),
    raises("%%distributed --check-collectives\ndist.all_reduce(torch.ones(4 + rank))"),
    code("%%distributed --check-collectives\ny = torch.ones(4)\ndist.all_reduce(y)\ny.tolist()"),
    md("## pdb in a rank\n\nIn a notebook (JupyterLab, Notebook 7, VS Code), `breakpoint()` in a session cell opens "
       "pdb's prompt in the stdin box, named after the rank: `(Pdb rank 1)`. pdb's commands act on that rank; "
       "besides them:\n\n"
       "- `ranks`: the ranks stopped in the debugger, and where;\n"
       "- `rank N`: talk to rank N;\n"
       "- `all c`: every stopped rank goes on (`all` sends any command to each);\n"
       "- `q`, or the stop button: debugging ends and the cell is interrupted, the ranks' state kept.\n\n"
       "A session of this run for example:\n\n"
       "```\n(Pdb rank 1) p x\n10\n(Pdb rank 1) x = 42\n(Pdb rank 1) c\n```\n\n"
       "This run is headless (no stdin): the breakpoint says so once, and the cell goes on."),
    code("%%distributed\nx = 10 * rank\nif rank == 1:\n    breakpoint()\nprint('went on', rank, x)"),
    md("`%dist_debug` opens pdb in the frame where the last failed cell raised, on the rank that failed first "
       "(`--rank R` for another). A rank keeps its last failure until its next cell. With a stdin:\n\n"
       "```\n%dist_debug\n> .../cell.py(4)scale()\n-> raise ValueError(f'bad factor {factor}')\n"
       "(Pdb rank 1) p factor\n-1\n(Pdb rank 1) up\n(Pdb rank 1) c\n```"),
    raises("%%distributed\ndef scale(t, factor):\n    if factor < 0:\n        raise ValueError(f'bad factor {factor}')\n"
           "    return t * factor\nscale(torch.ones(2), 1 - 2 * rank)"),
    code("%dist_debug"),
    code("%dist_stop"),
])

write("07_healing.ipynb", [
    md("# When a rank dies: the session keeps its state, and `%dist_heal` brings the rank back\n\n"
       "A session's ranks hold the work of an hour. One of them can still die: the OOM killer, a segfault in an "
       "extension, `os._exit` in a library. nbdist keeps the survivors with everything they hold, and rebuilds the "
       "dead rank from its peers."),
    code("%load_ext nbdist"),
    code("%dist_start -n 4"),
    md("A DDP model, Adam, and a `DistributedSampler` with its `DataLoader`: each rank reads its own quarter of "
       "the data."),
    code("%%distributed\n"
         "import os, torch, torch.distributed as dist\n"
         "from torch.utils.data import DataLoader, DistributedSampler, TensorDataset\n"
         "torch.manual_seed(0)\n"
         "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))\n"
         "opt = torch.optim.Adam(model.parameters(), lr=0.05)\n"
         "data = TensorDataset(torch.randn(256, 8, generator=torch.Generator().manual_seed(1)), torch.randn(256, 1))\n"
         "sampler = DistributedSampler(data, shuffle=True, seed=3)\n"
         "loader = DataLoader(data, batch_size=8, sampler=sampler)\n"
         "rank = dist.get_rank()\n\n"
         "def train(steps):\n"
         "    for _, (x, y) in zip(range(steps), loader):\n"
         "        opt.zero_grad()\n"
         "        loss = ((model(x) - y) ** 2).mean()\n"
         "        loss.backward()\n"
         "        opt.step()\n"
         "    return round(loss.item(), 4)\n\n"
         "train(20)"),
    md("Rank 2 dies in the middle of training (here it kills itself; the OOM killer would do the same). The cell "
       "fails with the cause, and the three survivors are freed from the all-reduce they waited in."),
    raises("%%distributed\nimport signal\nfor step in range(10**6):\n    if step == 5 and rank == 2:\n"
           "        os.kill(os.getpid(), signal.SIGKILL)\n    train(1)"),
    md("The session is *degraded*: `%dist_ps` says which rank is gone. A cell that needs every rank is refused in "
       "one line, before anything runs."),
    code("%dist_ps"),
    raises("%%distributed\ntrain(1)"),
    md("The survivors still hold the model: a cell on them alone can save it first."),
    code("%%distributed --ranks 0,1,3\nimport io\nbuf = io.BytesIO()\ntorch.save(model.module.state_dict(), buf)\n"
         "print(f'rank {rank}: {len(buf.getvalue())} bytes saved')"),
    md("`%dist_heal` starts rank 2 again, joins it to the process group in place, and copies from rank 0 "
       "every name that all survivors hold alike. `rank` differs between them, so it is listed and not copied."),
    code("%dist_heal"),
    code("%%distributed --ranks 2\nrank = dist.get_rank()"),
    md("A death in the middle of a step can leave the survivors' replicas apart; `%dist_sync` brings every rank "
       "to rank 0's. Then all four train on, in step, and rank 2's sampler reads its own quarter again."),
    code("%dist_sync"),
    code("%%distributed\n"
         "loss = train(20)\n"
         "checksum = torch.tensor([sum(p.double().sum().item() for p in model.parameters())])\n"
         "every = [torch.zeros(1, dtype=torch.float64) for _ in range(4)]\n"
         "dist.all_gather(every, checksum.double())\n"
         "print(f'rank {rank}: loss {loss}, replicas equal: {len({t.item() for t in every}) == 1}, '\n"
         "      f'sampler reads rank {sampler.rank}')"),
    code("%dist_stop"),
])

write("08_export.ipynb", [
    md("# From the notebook to the cluster: `%dist_export`\n\n"
       "A session knows which cells ran on which ranks, in what order, and which ones failed; which notebook "
       "functions and constants each one read; and the world it ran in. `%dist_export job.py` writes all of it as "
       "one script that runs the same under `python`, torchrun, srun and mpirun."),
    code("%load_ext nbdist"),
    md("The notebook's own definitions: the ranks get them by value."),
    code("import torch\n\n"
         "STEPS = 4\n\n"
         "def make_model():\n"
         "    torch.manual_seed(0)\n"
         "    return torch.nn.Linear(8, 1)"),
    code("%dist_start -n 2"),
    code("%%distributed\n"
         "import torch.distributed as dist\n"
         "model = torch.nn.parallel.DistributedDataParallel(make_model())\n"
         "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
         "g = torch.Generator().manual_seed(dist.get_rank())"),
    md("A cell that fails is left out of the job (its header says so)."),
    raises("%%distributed\nmodel(torch.randn(2, 3))  # the wrong width: it raises on every rank"),
    code("%%distributed\n"
         "for step in range(STEPS):\n"
         "    opt.zero_grad()\n"
         "    x = torch.randn(16, 8, generator=g)\n"
         "    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()\n"
         "    loss.backward()\n"
         "    opt.step()\n"
         "    print(f'step {step} loss {loss.item():.6f}')\n"
         "print('checksum', repr(sum(p.double().sum().item() for p in model.parameters())))"),
    md("Export the session. The script's header says how to run it, what the session ran on, and what was left "
       "out; `job.sbatch` beside it runs it with srun."),
    code("%dist_export job.py"),
    code("print(open('job.py').read())"),
    md("Run the job with plain `python` (it starts its own 2 ranks through `nbdist.launch`; no engine needed). Its "
       "lines are the session's, to the last digit: the same losses, the same checksum."),
    code("import subprocess, sys\n"
         "job = subprocess.run([sys.executable, 'job.py'], capture_output=True, text=True, timeout=300)\n"
         "print(job.stdout[-2000:], job.stderr[-2000:], f'exit code {job.returncode}')"),
    code("%dist_stop"),
])
