"""DDP training of a small model on synthetic data, on 4 CPU ranks, through nbdist.launch."""

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nbdist


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.body(x)


def train(steps=60, batch=64, lr=0.05):
    torch.manual_seed(0)
    true_w = torch.randn(16, 1)
    g = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank sees its own shard
    model = DDP(TinyNet())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x = torch.randn(batch, 16, generator=g)
        y = x @ true_w + 0.01 * torch.randn(batch, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
        if nbdist.is_main() and step % 20 == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    return losses


if __name__ == "__main__":
    t0 = time.monotonic()
    run = nbdist.launch(train, nprocs=4, join=False)
    print(f"run {run.run_id}: {run.nprocs} ranks, logs in {run.run_dir}")
    results = run.wait()
    with open(f"{run.run_dir}/rank0.stdout") as fh:
        print(fh.read(), end="")
    first, last = results[0][0], results[0][-1]
    assert all(r == results[0] for r in results.values()), "DDP keeps every rank in step"
    print(f"loss {first:.3f} -> {last:.3f} on {len(results)} ranks in {time.monotonic() - t0:.1f} s")
    print("processes left:", len(nbdist.ps()))
