"""Line assembly as a terminal would do it, and the text view in terminal IPython."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from nbdist.errors import format_rank_set
from nbdist.run.output import LineAssembler


def test_carriage_return_rewinds_the_line():
    a = LineAssembler()
    assert a.feed("10%\r") == []
    assert a.pending == "10%"
    assert a.feed("50%\r100%") == [] and a.pending == "100%"
    assert a.feed("\nnext\n") == ["100%", "next"]
    assert a.feed("keep\r\n") == ["keep"], "\\r\\n keeps the line"
    assert a.feed("\x1b[31mred\x1b[0m\n") == ["\x1b[31mred\x1b[0m"], "ANSI colours pass through"
    assert a.feed("tail") == [] and a.flush() == ["tail"]


def test_chunks_split_anywhere_give_the_same_lines():
    text = "a\rb\nccc\r\ndd\r\ree\n" * 3
    whole = LineAssembler().feed(text)
    for cut in range(1, len(text)):
        a = LineAssembler()
        assert a.feed(text[:cut]) + a.feed(text[cut:]) == whole


def test_rank_sets():
    assert format_rank_set([3]) == "rank 3"
    assert format_rank_set([1, 2, 3]) == "ranks 1-3"
    assert format_rank_set([0, 2, 3, 4, 7]) == "ranks 0,2-4,7"


def test_terminal_ipython_gets_the_text_view(tmp_path):
    script = tmp_path / "cells.ipy"
    script.write_text(
        "%%distributed -n 2\n"
        "import os, sys, time\n"
        "print('line from', os.environ['RANK'])\n"
        "for i in range(5):\n"
        "    sys.stderr.write(f'\\rprogress {i}/4'); sys.stderr.flush(); time.sleep(0.05)\n"
        "sys.stderr.write('\\n')\n"
    )
    ipython = os.path.join(os.path.dirname(sys.executable), "ipython")
    out = subprocess.run([ipython, "--no-banner", "--quick", "--colors=nocolor",
                          "--InteractiveShellApp.exec_lines=['%load_ext nbdist']", str(script)],
                         capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert "[rank 0] line from 0" in text and "[rank 1] line from 1" in text, text
    assert text.count("progress") == 2, "each rank's \\r bar is printed once, in its final state"
    assert "[rank 0!] progress 4/4" in text
    assert "finished: 2 ranks" in text


def test_a_flood_ends_with_the_last_line_in_view_and_bounded_kernel_memory():
    """2 ranks print 300,000 lines of 60 characters each, faster than the kernel reads them."""
    import psutil
    import rankfns

    import nbdist
    from nbdist.frontend.views import WidgetView

    me = psutil.Process()
    rss0 = me.memory_info().rss
    peak = [rss0]
    from nbdist.run.events import OutputChunk

    run = nbdist.launch(rankfns.flood, nprocs=2, init_process_group=False, join=False)
    notes = {0: [], 1: []}  # the lines that say where output was skipped, as every view gets them
    run.subscribe(lambda e: isinstance(e, OutputChunk) and notes[e.rank].extend(
        line for line in e.lines if line.startswith("[nbdist: ") and "skipped here" in line))
    view = WidgetView(run)  # the real widget view (no frontend here: its models still hold the outputs)
    view.start_flusher()
    while not run.done:
        peak[0] = max(peak[0], me.memory_info().rss)
        run._done.wait(0.05)
    assert run.wait() == {0: 300_000, 1: 300_000}
    view._thread.join(10)
    for rank in (0, 1):
        with open(os.path.join(run.run_dir, f"rank{rank}.stdout"), "rb") as fh:
            assert fh.read().count(b"\n") == 300_001, "the log file has every line"
        out = run.outputs[rank]
        assert out.lines[-1] == ("stdout", f"LAST LINE of rank {rank}"), "the run's last line is the rank's last line"
        assert view._shown[rank][-1][1] == f"LAST LINE of rank {rank}", "and the view shows it"
        skipped = sum(int(re.search(r"nbdist: ([\d,]+) lines", n).group(1).replace(",", "")) for n in notes[rank])
        print(f"rank {rank}: {out.total_lines:,} lines read, {skipped:,} skipped in {len(notes[rank])} jumps; "
              f"view holds {len(view._shown[rank])}")
        assert skipped > 0 and notes[rank] and f"rank{rank}.stdout" in notes[rank][-1], "the jump is said, with the log's path"
        assert out.total_lines + skipped >= 300_001
    growth = (peak[0] - rss0) / 2**20
    print(f"kernel RSS: +{growth:.0f} MiB at peak over {2 * 300_001:,} lines ({2 * 18.3:.0f} MB of output)")
    assert growth < 150, f"kernel memory grew {growth:.0f} MiB"
