"""pdb in session ranks from the notebook: breakpoint(), %dist_debug, through a real kernel that
answers stdin as a notebook does (jupyter_client's ``input_request``)."""

from __future__ import annotations

import os
import shutil
import sys
import time

import pytest
from conftest import nbdist_kernel


@pytest.fixture(scope="module")
def lab_kernel():
    with nbdist_kernel("warm") as k:
        yield k


@pytest.fixture
def kernel(lab_kernel):
    """The module's kernel with a 2-rank session of this test's own (the leak check runs per test)."""
    k = lab_kernel
    assert k.run("%dist_start -n 2").status == "ok"
    try:
        assert k.run("%%distributed --view text\nimport os\nrank = int(os.environ['RANK'])").status == "ok"
        yield k
    finally:
        k.run("%dist_stop")


def test_a_breakpoint_on_one_rank_takes_pdb_commands_and_the_next_cell_sees_the_change(kernel):
    res = kernel.run("%%distributed --view text\nx = 10 * rank\nif rank == 1:\n    breakpoint()\n    y = x + 1\n"
                     "print('after', rank, y if rank == 1 else '')",
                     answers=["l", "p x", "x = 99", "n", "p y", "c"], timeout=60)
    assert res.status == "ok", res.error_text
    assert [p for p, _ in res.prompts] == ["(Pdb rank 1) "] * 6, "the prompt names the rank"
    out = res.stdout
    listed = [line for line in out.splitlines() if line.lstrip()[:1].isdigit()]
    assert any("breakpoint()" in line and line.split()[0] == "4" for line in listed), out
    assert any("->" in line and "y = x + 1" in line and line.split()[0] == "5" for line in listed), "l: the cell's lines"
    assert "\n10\n" in out and "\n100\n" in out, out
    assert "[rank 1] after 1 100" in out and "[rank 0] after 0" in out
    assert kernel.run("%%distributed --view text --ranks 1\nx").result == "99"


def test_breakpoints_on_two_ranks_ranks_rank_n_and_all_c(kernel):
    """Either rank may reach its breakpoint first (the prompt goes to the lowest rank paused at the
    first look: on a busy box, rank 1 now and then): ``ranks`` is asked until both are listed."""
    badges = []

    def answer(prompt, res):
        badges.extend(v for v in res.widget_values.values() if isinstance(v, str) and "paused" in v)
        if len(_last_listing(res.stdout)) < 2 and len(res.prompts) < 60:
            time.sleep(0.2)
            return "ranks"
        done = [a for _, a in res.prompts if a != "ranks"]
        return ["rank 1", "p rank * 100", "all c"][len(done)]

    res = kernel.run("%%distributed --view widget\nbreakpoint()\nz = rank + 5", answers=answer, timeout=60)
    assert res.status == "ok", res.error_text
    assert [a for _, a in res.prompts if a != "ranks"] == ["rank 1", "p rank * 100", "all c"], res.prompts
    first = int(res.prompts[0][0].split()[-1].rstrip(")"))
    assert {p for p, a in res.prompts if a == "ranks"} == {f"(Pdb rank {first}) "}, res.prompts
    assert [p for p, a in res.prompts if a in ("p rank * 100", "all c")] == ["(Pdb rank 1) "] * 2, res.prompts
    out = res.stdout
    listing = _last_listing(out)
    assert [line.split("   <-")[0] for line in listing] == ["  rank 0: cell.py:3 in <module>",
                                                            "  rank 1: cell.py:3 in <module>"], out
    assert listing[first].endswith("<- current"), out
    if first == 0:  # a switch says where the new rank stands (rank 1 first: it was said before)
        assert "nbdist: rank 1 stopped at cell.py:3 in <module>" in out, out
    assert "\n100\n" in out, out
    assert any("at cell.py:3 in &lt;module&gt;" in b or "at cell.py:3 in <module>" in b for b in badges), badges
    assert kernel.run("%%distributed --view text\nz").result == "5"


def test_dist_debug_opens_pdb_in_the_frame_that_raised(kernel):
    res = kernel.run("%%distributed --view text\ndef f(v):\n    w = v * 2\n    raise ValueError('bad')\n"
                     "if rank == 1:\n    f(7)")
    assert res.status == "error" and "rank 1 failed first" in res.error_text
    res = kernel.run("%dist_debug", answers=["p v, w", "up", "p rank", "c"], timeout=60)
    assert res.status == "ok", res.error_text
    assert [p for p, _ in res.prompts] == ["(Pdb rank 1) "] * 4
    assert "cell.py(4)f()\n-> raise ValueError('bad')" in res.stdout and "(7, 14)" in res.stdout, res.stdout
    assert "cell.py(6)<module>()\n-> f(7)" in res.stdout and "\n1\n" in res.stdout
    res = kernel.run("%dist_debug --rank 0")
    assert "rank 0 has no failed cell to debug" in res.stdout
    assert kernel.run("%%distributed --view text\n1 + 1").status == "ok"
    assert "rank 1 has no failed cell to debug" in kernel.run("%dist_debug").stdout, "a new cell forgets the failure"


def test_the_stop_button_ends_debugging_and_keeps_the_state(kernel):
    def press_stop(prompt, res):
        kernel.km.interrupt_kernel()
        time.sleep(5)  # never answered: the stop button ends the prompt
        return "c"

    msg = kernel.send("%%distributed --view text\nkept = 'yes'\nif rank == 0:\n    breakpoint()\nimport time\n"
                      "time.sleep(60)")
    res = kernel.collect(msg, timeout=60, answers=press_stop)
    assert res.status == "error" and "interrupted: ranks 0-1 idle again, their state kept" in res.error_text, res.error_text
    assert kernel.run("%%distributed --view text\nkept").result == "'yes'"


def test_without_stdin_a_breakpoint_says_so_once_and_the_cell_goes_on(kernel):
    msg = kernel.kc.execute("%%distributed --view text\nfor i in range(3):\n    breakpoint()\nrank", allow_stdin=False)
    res = kernel.collect(msg, timeout=60)
    assert res.status == "ok" and res.result == "0", res.error_text
    said = res.stdout + res.stderr
    assert said.count("reached a breakpoint at cell.py:2 in <module>; this cell has no stdin") == 1, said


def test_a_one_shot_cell_says_the_debugger_needs_a_session(kernel):
    res = kernel.run("%%distributed --fresh -n 2 --view text\nbreakpoint()\nprint('went on')")
    assert res.status == "ok", res.error_text
    said = res.stdout + res.stderr
    assert "breakpoint() at cell.py:2 skipped: the debugger needs a session's ranks" in said and "went on" in said


def _last_listing(out: str) -> list[str]:
    """The lines of the last ``ranks`` listing (``  rank N: where``, N rising; two listings may
    follow each other with nothing between)."""
    blocks: list[list[str]] = []
    previous = None
    for line in out.splitlines():
        rank = line[7:].split(":")[0] if line.startswith("  rank ") else ""
        if not rank.isdigit():
            previous = None
            continue
        if previous is None or int(rank) <= previous:
            blocks.append([])
        blocks[-1].append(line)
        previous = int(rank)
    return blocks[-1] if blocks else []


def test_eight_ranks_stopped_at_once_are_listed_debugged_one_by_one_and_let_go_together(lab_kernel):
    """At 8 ranks, every one in pdb at the same time: ``ranks`` lists them as they arrive, ``rank 7``
    talks to the last, what it changes stays, and ``all c`` lets all 8 go on at once."""
    k = lab_kernel
    assert k.run("%dist_start -n 8").status == "ok"
    try:
        def answer(prompt, res):
            # Each rank reaches its breakpoint in its own time: ask again until all 8 are listed.
            if len(_last_listing(res.stdout)) < 8 and len(res.prompts) < 60:
                time.sleep(0.2)
                return "ranks"
            done = [a for _, a in res.prompts if a != "ranks"]
            return ["rank 7", "p rank", "mark = 'set in pdb'", "all c"][len(done)]

        res = k.run("%%distributed --view text\nimport torch.distributed as dist\nrank = dist.get_rank()\n"
                    "mark = 'plain'\nbreakpoint()\nprint('went on', rank, mark)", answers=answer, timeout=120)
        assert res.status == "ok", res.error_text
        asked = [a for _, a in res.prompts if a != "ranks"]
        assert asked == ["rank 7", "p rank", "mark = 'set in pdb'", "all c"], res.prompts
        listing = _last_listing(res.stdout)
        assert [line.split(":")[0].strip() for line in listing] == [f"rank {r}" for r in range(8)], res.stdout
        assert all("cell.py:6 in <module>" in line for line in listing), listing  # pdb stops on the next line
        assert [p for p, a in res.prompts if a in ("p rank", "mark = 'set in pdb'")] == ["(Pdb rank 7) "] * 2
        assert "\n7\n" in res.stdout, res.stdout
        assert "[rank 7] went on 7 set in pdb" in res.stdout, res.stdout
        assert all(f"[rank {r}] went on {r} plain" in res.stdout for r in range(7)), res.stdout
        assert res.stdout.count("nbdist: rank 7 stopped at") == 1, "said once: p and = don't move rank 7"
        assert k.run("%%distributed --view text --ranks 7\nmark").result == "'set in pdb'"
    finally:
        k.run("%dist_stop")


@pytest.mark.parametrize("engine", ["torchrun", "mpirun", "srun"])
def test_a_breakpoint_under_each_engine_takes_commands_from_the_notebook(lab_kernel, engine, request):
    """Ranks started by torchrun, mpirun or srun stop in pdb as spawned ones do: the prompt and the
    commands travel the rank's channel to the kernel, whatever started the rank."""
    k = lab_kernel
    extra = ""
    if engine == "mpirun" and not (shutil.which("mpiexec", path=os.path.dirname(sys.executable))
                                   or shutil.which("mpiexec")):
        pytest.skip("mpiexec not installed (pip install mpi4py mpich)")
    if engine == "srun":
        cluster = request.getfixturevalue("slurm_cluster")
        # The kernel was started before this test: point its srun at the test's Slurm.
        assert k.run(f"import os; os.environ['SLURM_CONF'] = {cluster.env['SLURM_CONF']!r}").status == "ok"
        extra = " --launcher-args '--overcommit'"  # 2 tasks on the CI box's CPUs
    assert k.run(f"%dist_start -n 2 --launcher {engine}{extra}").status == "ok"
    try:
        res = k.run("%%distributed --view text\nimport torch.distributed as dist\nrank = dist.get_rank()\n"
                    "if rank == 1:\n    breakpoint()\nprint('went on', rank, rank * 10)",
                    answers=["p rank", "rank = 5", "c"], timeout=180)
        assert res.status == "ok", res.error_text + res.stdout
        assert [p for p, _ in res.prompts] == ["(Pdb rank 1) "] * 3
        assert "\n1\n" in res.stdout, res.stdout
        assert "[rank 1] went on 5 50" in res.stdout and "[rank 0] went on 0 0" in res.stdout, res.stdout
    finally:
        k.run("%dist_stop")
