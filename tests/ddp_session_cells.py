"""What the death and heal tests (test_rank_death, test_heal) run in a live 4-rank session through a
real kernel: a DDP model, Adam, a DistributedSampler and its DataLoader; and how they ask the kernel
about its session."""

from __future__ import annotations

TRAINING = """import os, torch, torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(1)), torch.randn(64, 1))
sampler = DistributedSampler(data, shuffle=True, seed=3)
loader = DataLoader(data, batch_size=4, sampler=sampler)
rank = dist.get_rank()
def train(steps):
    for i, (x, y) in zip(range(steps), loader):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    return loss.item()
"""
# Every user name a rank holds (an expression for a rank's cell).
USER_NAMES = ("sorted(k for k in globals() if not k.startswith('_') and k not in ('In', 'Out', 'exit', 'quit', "
              "'get_ipython'))")


def setup_cell(extra: str = "") -> str:
    """The session cell that builds the training state (plus ``extra``), then trains 3 steps."""
    return f"%%distributed --view text\n{TRAINING}{extra}train(3)\n"


def session_value(kernel, expr: str) -> str:
    """``expr`` about the kernel's live session (``_s``), evaluated in the kernel."""
    res = kernel.run("from nbdist.frontend.session_magics import live_session as _ls\n_s = _ls()\n" + expr)
    assert res.status == "ok", res.error_text
    return res.result
