"""Rich output from session ranks stays bounded and cheap: the kernel keeps each rank's last bundles
(the rest counted and said), a view appends a display and never sends one twice, and the stop button
during a flood of large displays leaves the session idle and usable at once."""

from __future__ import annotations

import contextlib
import json
import queue
import time

import pytest

import nbdist
from conftest import nbdist_kernel
from nbdist.run.display_backlog import RECORD_DISPLAYS, DisplayBacklog
from nbdist.run.events import DisplayEvent, OutputChunk

FLOOD = "from IPython.display import display, HTML\nfor i in range(10**6):\n    display(HTML('<b>x</b>' * 20000))"


def test_the_backlog_keeps_each_ranks_newest_bundles_in_order_and_counts_the_rest():
    backlog = DisplayBacklog(max_count=3, max_bytes=100)
    for i in range(5):
        backlog.add(DisplayEvent(0, {"text/plain": f"a{i}"}))
        backlog.add(DisplayEvent(1, {"text/plain": f"b{i}"}))
    held = backlog.snapshot()
    assert [e.data["text/plain"] for e in held.events] == ["a2", "b2", "a3", "b3", "a4", "b4"], "newest, in order"
    assert held.dropped == {0: 2, 1: 2}
    assert held.dropped_note(0, "why") == "[nbdist: 2 displays of rank 0 not shown here, why]"
    assert held.dropped_note(5, "why") is None
    backlog.add(DisplayEvent(1, {"text/plain": "x" * 60, "text/html": "y" * 40}))  # 100 bytes: the rest must go
    assert [len(e.data["text/plain"]) for e in backlog.snapshot().events if e.rank == 1] == [60]
    backlog.add(DisplayEvent(1, {"text/plain": "z" * 500}))  # alone past the cap: the newest is kept all the same
    taken = backlog.take()
    assert [e.data["text/plain"][0] for e in taken.events if e.rank == 1] == ["z"]
    assert taken.dropped == {0: 2, 1: 6}
    assert len(backlog) == 0 and backlog.take().dropped == {}, "take empties it"
    backlog.add(DisplayEvent(2, {"application/json": {"k": "v" * 200}}))
    assert len(backlog) == 1 and backlog.ranks() == {2}, "a JSON bundle counts by what it encodes to"


def test_a_cells_record_keeps_each_ranks_last_displays_and_a_late_view_is_told_of_the_rest():
    with nbdist.Session(nprocs=2) as session:
        assert session.wait_ready(120)
        cell = session.execute("from IPython.display import display\nfor i in range(250):\n"
                               "    display({'text/plain': str(i)}, raw=True)", join=False)
        cell.wait(60)
        for rank in (0, 1):
            kept = [int(d.data["text/plain"]) for d in cell.displays if d.rank == rank]
            assert kept == list(range(250 - RECORD_DISPLAYS, 250)), f"rank {rank} keeps its last {RECORD_DISPLAYS}"
        late: list = []
        cell.subscribe(late.append)  # a view that comes late: told first what it can't be shown
        notes = [e.lines[0] for e in late if isinstance(e, OutputChunk) and e.stream == "stderr"]
        assert notes == [f"[nbdist: 150 displays of rank {r} not shown here, the kernel keeps each rank's last "
                         f"{RECORD_DISPLAYS} or 50 MB]" for r in (0, 1)]
        assert len([e for e in late if isinstance(e, DisplayEvent)]) == 2 * RECORD_DISPLAYS
        # By size: 4 MiB bundles, 50 MiB a rank; rank 1's record holds the last 12.
        cell = session.execute("from IPython.display import display\nfor i in range(20):\n"
                               "    display({'text/plain': str(i).rjust(4 << 20)}, raw=True)", ranks=[1], join=False)
        cell.wait(60)
        assert [int(d.data["text/plain"]) for d in cell.displays] == list(range(8, 20))
        assert session.execute("1") == {0: 1, 1: 1}


def _counter(seen: dict):
    """An ``on_message`` that counts what IOPub carried: messages, the largest, the tab displays."""
    def on_message(msg):
        seen["messages"] = seen.get("messages", 0) + 1
        seen["largest"] = max(seen.get("largest", 0), len(json.dumps(msg["content"])))
        if msg["msg_type"] == "comm_open" and msg["content"]["data"]["state"].get("outputs"):
            seen["tab_displays"] = seen.get("tab_displays", 0) + 1

    return on_message


def test_the_stop_button_during_a_flood_of_large_displays_leaves_the_session_idle_and_usable_at_once():
    """Both ranks loop on a 160 KB HTML display: rank 0's go to the cell, rank 1's to its tab, each
    display once (no message carries two); the stop 2 s in is answered at once, and so is the next cell."""
    with nbdist_kernel("warm") as k:
        assert k.run("%dist_start -n 2").status == "ok"
        assert k.run("%%distributed\nimport torch, torch.distributed as dist\nx = 1").status == "ok"
        seen: dict = {}
        msg_id = k.send("%%distributed\n" + FLOOD)
        deadline = time.monotonic() + 30  # the flood, drained as a frontend does, until rank 1's tab shows some
        while seen.get("tab_displays", 0) <= 5 and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                k.collect("-", timeout=0.5, on_message=_counter(seen))
        assert seen.get("tab_displays", 0) > 5, f"rank 1's displays reach its tab as they come: {seen}"
        k.km.interrupt_kernel()
        res = k.collect(msg_id, timeout=30, on_message=_counter(seen))
        assert res.status == "error" and res.error["ename"] == "RunStoppedError", res.error_text
        stopped = res.seconds
        t0 = time.monotonic()
        res = k.run("%%distributed --view text\nt = torch.ones(1); dist.all_reduce(t); t.item(), x")
        assert res.status == "ok" and "(2.0, 1)" in res.result, res.error_text
        print(f"flood stopped: idle after {stopped:.2f} s, next cell {time.monotonic() - t0:.2f} s; "
              f"{seen['messages']} IOPub messages, largest {seen['largest'] / 1e3:.0f} KB")
        assert seen["largest"] < 400_000, "one display a message: nothing shown is sent again"
        # The goal is idle within 2 s (benchmarks/bench_rich_output.py); this client's own draining of
        # the backlog counts here, and a busy box slows it: the bound tells a stop from a hang (60 s before).
        assert stopped < 5.0 or pytest.fail(f"the stop took {stopped:.2f} s (goal: idle within 2 s)")
        k.run("%dist_stop")
