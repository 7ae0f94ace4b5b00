"""The tour's screenshots (docs/tour/*.png), taken in a real JupyterLab by the browser suite's harness.

    .venv/bin/python scripts/screenshots.py [--only NAME ...]      # or: bash scripts/screenshots.sh

Each shot is a small notebook run the way a person runs it (tests/lab_browser.py: JupyterLab in
Debian's headless Chromium through playwright), then a picture of the cells it shows. Run it again
whenever the view changes: the docs never hold a screenshot taken by hand. Every wait has a deadline;
every kernel is shut down and the lab stopped before it returns.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the harness (lab_browser) and its wait_for (conftest)

from conftest import wait_for  # noqa: E402
from lab_browser import Notebook, missing_for_lab, running_lab  # noqa: E402

OUT = os.path.join(ROOT, "docs", "tour")
PAD = 8  # pixels around the cells a shot frames
# A session whose ranks are up before the next cell: that cell then shows as it does on a live session.
READY = ("%dist_start -n {n}\nimport nbdist.frontend.session_magics as _magics\n"
         "_magics.live_session().wait_ready(120)")

TRAIN = ("%%distributed --nprocs 2\n"
         "import time, torch.distributed as dist\nfrom tqdm import tqdm\n"
         "rank = dist.get_rank()\n"
         "for step in tqdm(range(40), desc='training', disable=rank != 0):\n"
         "    time.sleep(0.03)\n"
         "    if step % 10 == 0:\n"
         "        print(f'rank {rank} step {step} loss {1 / (step + 1):.3f}', flush=True)\n"
         "rank")


class ShotNotebook(Notebook):
    """A notebook of the harness that, closed because a step failed, first keeps what the page showed."""

    def close(self):
        if sys.exc_info()[0] is not None:
            path = os.path.join(ROOT, ".artifacts", f"screenshots-failed-{self.name}.png")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.page.screenshot(path=path, full_page=True)
            print(f"screenshots: {self.name} failed; the page is in {os.path.relpath(path, ROOT)}", file=sys.stderr)
        super().close()


def shoot(nb: Notebook, cells: list[int], name: str) -> str:
    """A picture of ``cells`` (their union, a few pixels around), saved as docs/tour/NAME.png."""
    nb.page.set_viewport_size({"width": 1280, "height": 1600})  # room for a few cells at once
    nb.cell(cells[0]).evaluate("el => el.scrollIntoView({block: 'start'})")
    nb.page.wait_for_timeout(300)  # JupyterLab draws the cells it scrolled to
    boxes = [nb.cell(i).bounding_box() for i in cells]
    x0, y0 = min(b["x"] for b in boxes) - PAD, min(b["y"] for b in boxes) - PAD
    x1 = max(b["x"] + b["width"] for b in boxes) + PAD
    y1 = min(max(b["y"] + b["height"] for b in boxes) + PAD, 1600)
    path = os.path.join(OUT, f"{name}.png")
    nb.page.screenshot(path=path, clip={"x": max(x0, 0), "y": max(y0, 0), "width": x1 - max(x0, 0),
                                        "height": y1 - max(y0, 0)})
    print(f"saved {os.path.relpath(path, ROOT)}", flush=True)
    return path


def run(nb: Notebook, i: int, timeout: float = 120) -> None:
    nb.run(i)
    nb.wait_done(i, timeout=timeout)


def view_quick(lab):
    """Quick session cells: their lines as a plain cell's, identical ones folded across ranks; no widget."""
    nb = ShotNotebook(lab, "view-quick", [
        "%load_ext nbdist",
        READY.format(n=4),
        "%%distributed\nimport torch.distributed as dist   # the ranks' first import: not a quick cell",
        "%%distributed\nprint('checkpoint saved')",
        "%%distributed\nprint('loss', 0.25 * (dist.get_rank() + 1))",
        "%dist_stop",
    ])
    try:
        for i in range(5):
            run(nb, i)
        nb.output(3).get_by_text("[0-3] checkpoint saved").wait_for(timeout=30_000)
        nb.output(4).get_by_text("[3] loss 1.0").wait_for(timeout=30_000)
        paths = [shoot(nb, [3, 4], "view-quick")]
        run(nb, 5)
        return paths
    finally:
        nb.close()


def view_tabs(lab):
    """A longer cell grows into the live view: a tab per rank, badges, tqdm's bar as one line."""
    nb = ShotNotebook(lab, "view-tabs", ["%load_ext nbdist", TRAIN])
    try:
        run(nb, 0)
        run(nb, 1)
        out = nb.output(1)
        tab = out.locator(".lm-TabBar-tab", has_text="rank 0")
        tab.wait_for(timeout=30_000)
        wait_for(lambda: "✓" in tab.inner_text(), 20, interval=0.2, what="rank 0's badge to say finished")
        tab.click()
        shown = out.locator(".widget-tab-contents > .lm-Widget:not(.lm-mod-hidden)")  # the selected tab's panel
        shown.get_by_text("rank 0 step 30").first.wait_for(timeout=10_000)
        return [shoot(nb, [1], "view-tabs")]
    finally:
        nb.close()


def failed(lab):
    """A rank raises: the cell names the first rank to fail, with the traceback in the cell's lines."""
    nb = ShotNotebook(lab, "failed", ["%load_ext nbdist",
                                  "%%distributed --nprocs 2\nimport torch.distributed as dist\n"
                                  "shard = [1.0, 2.0] if dist.get_rank() == 0 else []\n"
                                  "if not shard:\n    raise ValueError(f'empty shard on rank {dist.get_rank()}')\n"
                                  "dist.barrier()"])
    try:
        run(nb, 0)
        run(nb, 1)
        nb.output(1).get_by_text("rank 1 failed first").first.wait_for(timeout=30_000)
        return [shoot(nb, [1], "failed")]
    finally:
        nb.close()


def session(lab):
    """A session: the model a cell built trains on in the next cell; the stop button keeps it."""
    nb = ShotNotebook(lab, "session", [
        "%load_ext nbdist",
        READY.format(n=2),
        "%%distributed\nimport torch, torch.distributed as dist\n"
        "torch.manual_seed(0)\nmodel = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "def train(steps):\n"
        "    for _ in range(steps):\n"
        "        x = torch.randn(32, 8)\n"
        "        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()\n"
        "        opt.zero_grad(); loss.backward(); opt.step()\n"
        "    return round(loss.item(), 3)\n"
        "train(20)",
        "%%distributed\ntrain(200)     # the same model and optimizer, still on the ranks",
        "%dist_stop",
    ])
    try:
        for i in range(4):
            run(nb, i)
        paths = [shoot(nb, [1, 2, 3], "session")]
        run(nb, 4)
        return paths
    finally:
        nb.close()


def debugger(lab):
    """breakpoint() on rank 1: its pdb prompt in the notebook's stdin box."""
    nb = ShotNotebook(lab, "debugger", [
        "%load_ext nbdist",
        READY.format(n=2),
        "%%distributed\nimport torch.distributed as dist\nrank = dist.get_rank()\nx = 10 * rank\n"
        "if rank == 1:\n    breakpoint()\nprint('went on', rank, x)",
        "%dist_stop",
    ])
    try:
        run(nb, 0)
        run(nb, 1)
        nb.run(2)
        out = nb.output(2)
        stdin = out.locator(".jp-OutputArea-stdin-item:not(.jp-OutputArea-stdin-hiding) > .jp-Stdin").last
        stdin.wait_for(timeout=60_000)
        wait_for(lambda: "(Pdb rank 1)" in stdin.inner_text(), 30, interval=0.2, what="rank 1's prompt")
        box = stdin.locator(".jp-Stdin-input")
        box.fill("p x")
        box.press("Enter")
        out.get_by_text("10", exact=True).first.wait_for(timeout=30_000)
        stdin = out.locator(".jp-OutputArea-stdin-item:not(.jp-OutputArea-stdin-hiding) > .jp-Stdin").last
        stdin.wait_for(timeout=30_000)
        stdin.locator(".jp-Stdin-input").fill("l")
        paths = [shoot(nb, [2], "debugger")]
        stdin.locator(".jp-Stdin-input").fill("c")
        stdin.locator(".jp-Stdin-input").press("Enter")
        nb.wait_done(2, timeout=60)
        run(nb, 3)
        return paths
    finally:
        nb.close()


def data(lab):
    """Data in and out: the cell reads a notebook tensor, --pull brings a rank's result back."""
    nb = ShotNotebook(lab, "data", [
        "%load_ext nbdist",
        "import torch\ndata = torch.arange(8.0)",
        "%%distributed --nprocs 2 --pull part\nimport torch.distributed as dist\n"
        "part = data.tensor_split(dist.get_world_size())[dist.get_rank()] * 10   # `data` came from the notebook\n"
        "part.sum().item()",
        "part, _dist.results",
    ])
    try:
        for i in range(4):
            run(nb, i)
        nb.output(3).get_by_text("tensor(").first.wait_for(timeout=10_000)
        return [shoot(nb, [1, 2, 3], "data")]
    finally:
        nb.close()


def warm(lab):
    """Warm start: the template, ready, and %dist_ps listing it."""
    nb = ShotNotebook(lab, "warm", ["%load_ext nbdist", "%dist_warm", "%%distributed --nprocs 2\n'forked in milliseconds'",
                                "%dist_ps"])
    try:
        for i in range(4):
            run(nb, i)
        nb.output(3).get_by_text("warm template pid").first.wait_for(timeout=10_000)
        return [shoot(nb, [1, 2, 3], "warm")]
    finally:
        nb.close()


SHOTS = {"view-quick": view_quick, "view-tabs": view_tabs, "failed": failed, "session": session,
         "debugger": debugger, "data": data, "warm": warm}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", choices=sorted(SHOTS), help="take only these shots")
    args = ap.parse_args(argv)
    reason = missing_for_lab()
    if reason:
        print(f"screenshots: {reason}", file=sys.stderr)
        return 2
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nbdist-shots-") as tmp:
        home, root = os.path.join(tmp, "home"), os.path.join(tmp, "root")
        os.makedirs(home)
        os.makedirs(root)
        with running_lab(home, root) as lab:
            for name in args.only or SHOTS:
                SHOTS[name](lab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
