"""A rank's death keeps the session (issue 28, item 1), through a real kernel: the survivors keep every
name, the session is degraded, a cell on the survivors runs, a cell that needs the dead rank is refused
in one line, and a collective on a group that lacks it fails at once, naming it. Deaths of each kind:
SIGKILL idle, SIGKILL during a DDP step, SIGSEGV, ``os._exit(3)``; then every rank dead is lost."""

from __future__ import annotations

import ast
import os
import signal
import time

import pytest
from conftest import marked_pids, nbdist_kernel, wait_for
from ddp_session_cells import USER_NAMES, session_value, setup_cell

pytestmark = pytest.mark.timeout(300)

SETUP = setup_cell()
# What each survivor holds: every user name, and the values that must not change under a death.
STATE = (f"{USER_NAMES}, round(sum(p.sum().item() for p in model.parameters()), 6), "
         "sum(int(s['step']) for s in opt.state.values()), rank, len(sampler)")


def _pid(kernel, rank: int) -> int:
    return int(session_value(kernel, f"_s.pids[{rank}]"))


def _status(kernel) -> str:
    return session_value(kernel, "_s.status").strip("'")


@pytest.fixture
def kernel():
    with nbdist_kernel("warm") as k:
        yield k


def test_a_rank_killed_while_idle_leaves_a_degraded_session_whose_survivors_keep_every_name(kernel):
    assert kernel.run("%dist_start -n 4").status == "ok"
    res = kernel.run(SETUP)
    assert res.status == "ok", res.error_text + res.stdout
    before = {r: kernel.run(f"%%distributed --view text --ranks {r}\n{STATE}").result for r in (0, 1, 3)}
    sid = session_value(kernel, "_s.session_id").strip("'")
    dead = _pid(kernel, 2)
    os.kill(dead, signal.SIGKILL)
    wait_for(lambda: _status(kernel) == "degraded", 20, what="the session to be degraded")
    after = {r: kernel.run(f"%%distributed --view text --ranks {r}\n{STATE}").result for r in (0, 1, 3)}
    assert after == before, (before, after)
    # A cell that needs rank 2: one line, naming it, the heal and the restart; nothing runs.
    res = kernel.run("%%distributed --view text\nprint('ran')")
    assert res.status == "error" and "ran" not in res.stdout
    line = res.error_text
    assert f"rank 2 was killed by SIGKILL (pid {dead})" in line and "%dist_heal" in line and "%dist_restart" in line
    assert "--ranks 0,1,3" in line, line
    # A collective on the survivors fails at once, naming rank 2; it never hangs.
    start = time.monotonic()
    res = kernel.run("%%distributed --view text --ranks 0,1,3\ndist.all_reduce(torch.ones(1))")
    assert res.status == "error" and "lacks rank 2" in res.error_text + res.stdout, res.error_text
    assert time.monotonic() - start < 10
    assert _status(kernel) == "degraded"
    # The survivors still train on their own (no collective in a local step), and save what they hold.
    res = kernel.run("%%distributed --view text --ranks 0,1,3\nimport io\nbuf = io.BytesIO()\n"
                     "torch.save(model.module.state_dict(), buf)\nlen(buf.getvalue()) > 0")
    assert res.status == "ok" and res.result == "True", res.error_text
    # The cell's view (the default one), %dist_ps, the session's repr: which rank is gone.
    res = kernel.run("%%distributed --view widget --ranks 0,1,3\nprint('on the survivors')")
    assert res.status == "ok" and any("rank 2 gone (%dist_heal)" in str(v) for v in res.widget_values.values()), \
        res.widget_values
    assert "rank 2 was killed by SIGKILL" in kernel.run("%dist_ps").stdout
    assert "degraded" in session_value(kernel, "repr(_s)")
    assert dead not in marked_pids(sid)
    kernel.run("%dist_stop")
    wait_for(lambda: not marked_pids(sid), 5, what="the session's ranks to go")


@pytest.mark.parametrize("death", ["SIGKILL in a DDP step", "SIGSEGV", "os._exit(3)"])
def test_a_rank_that_dies_in_a_cell_fails_it_with_the_cause_and_frees_the_survivors(kernel, death, tmp_path):
    assert kernel.run("%dist_start -n 4").status == "ok"
    assert kernel.run(SETUP).status == "ok"
    before = {r: kernel.run(f"%%distributed --view text --ranks {r}\n{STATE}").result for r in (0, 2, 3)}
    if death == "os._exit(3)":
        body = "train(2)\nif rank == 1:\n    os._exit(3)\ntrain(50)"
    elif death == "SIGSEGV":
        body = "train(2)\nif rank == 1:\n    import ctypes; ctypes.string_at(0)\ntrain(50)"
    else:  # the kernel kills rank 1 while every rank is in the loop's collectives
        flag = tmp_path / "began"
        body = (f"import pathlib, time\npathlib.Path({str(flag)!r}, str(rank)).parent.mkdir(exist_ok=True)\n"
                f"pathlib.Path({str(flag)!r}, str(rank)).touch()\nfor _ in range(10000):\n    train(1)")
    victim = _pid(kernel, 1)
    msg = kernel.send(f"%%distributed --view text\n{body}")
    if death.startswith("SIGKILL"):
        began = tmp_path / "began"
        wait_for(lambda: began.exists() and len(list(began.glob("*"))) == 4, 30, what="every rank in the loop")
        time.sleep(0.3)
        os.kill(victim, signal.SIGKILL)
    res = kernel.collect(msg, 60)
    assert res.status == "error", res.stdout
    said = res.error_text + res.stdout
    how = {"os._exit(3)": "exited with code 3", "SIGSEGV": "killed by SIGSEGV"}.get(death, "killed by SIGKILL")
    assert f"rank 1 failed first: {how}" in said, said
    assert "ranks 0,2-3 keep their state" in said, said
    assert _status(kernel) == "degraded"
    # Every survivor is idle with every name it had; training moved the replicas together.
    after = {r: kernel.run(f"%%distributed --view text --ranks {r}\n{STATE}").result for r in (0, 2, 3)}
    for r in (0, 2, 3):
        names_before, names_after = ast.literal_eval(before[r])[0], ast.literal_eval(after[r])[0]
        assert set(names_before) <= set(names_after), (r, names_before, names_after)
        assert ast.literal_eval(after[r])[3] == r  # its own rank, not another's
    res = kernel.run("%%distributed --view text --ranks 0,2,3\nround(sum(p.sum().item() for p in model.parameters()), 5)")
    assert res.status == "ok", res.error_text
    kernel.run("%dist_stop")


def test_a_session_whose_every_rank_died_is_lost(kernel):
    assert kernel.run("%dist_start -n 2").status == "ok"
    assert kernel.run("%%distributed --view text\nx = 1").status == "ok"
    pids = [_pid(kernel, 0), _pid(kernel, 1)]
    os.kill(pids[0], signal.SIGKILL)
    wait_for(lambda: _status(kernel) == "degraded", 20, what="the session to be degraded")
    os.kill(pids[1], signal.SIGKILL)
    wait_for(lambda: _status(kernel) == "broken", 20, what="the session to be lost")
    res = kernel.run("%%distributed --view text --ranks 1\nx")
    assert res.status == "error" and "every rank died" in res.error_text, res.error_text
    kernel.run("%dist_stop")
