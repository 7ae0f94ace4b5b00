"""``%dist_export`` of a long session, through a real kernel, against reading its cells' records.

    .venv/bin/python benchmarks/bench_export.py [--cells 100] [--repeat 3]

One kernel (jupyter_client), as users have it: a notebook cell of definitions, a warm 2-rank session,
then ``--cells`` session cells, each reading the notebook's function and a constant (so each one's
notebook values are resolved to the notebook cell that defined them), every tenth on rank 1 only,
every twenty-fifth failing. Each repeat times ``%dist_export`` as the user waits for it (the cell's
round trip) and the export's own time (its message says it).

Baseline, in the same run: an empty cell's round trip in the same kernel (what any magic costs).
Goal (issue 29): a 100-cell session exported within 1 s. Prints medians; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from conftest import nbdist_kernel

    with nbdist_kernel("warm") as k, tempfile.TemporaryDirectory() as tmp:
        assert k.run("SCALE = 3\ndef bump(x):\n    return x * SCALE").status == "ok"
        assert k.run("%dist_start -n 2").status == "ok"
        t0 = time.monotonic()
        for i in range(a.cells):
            ranks = " --ranks 1" if i % 10 == 9 else ""
            body = "1 / 0" if i % 25 == 24 else f"v{i % 7} = bump({i})"
            k.run(f"%%distributed --view text{ranks}\n{body}", cell_id=f"cell-{i}")
        built = time.monotonic() - t0
        empty, waited, own = [], [], []
        for r in range(a.repeat):
            t = time.monotonic()
            k.run("pass")
            empty.append(time.monotonic() - t)
            t = time.monotonic()
            res = k.run(f"%dist_export {os.path.join(tmp, f'job{r}.py')}")
            waited.append(time.monotonic() - t)
            assert res.status == "ok", res.error_text
            own.append(float(re.search(r"in ([\d.]+) s", res.stdout).group(1)))
        k.run("%dist_stop")
    print(f"session of {a.cells} cells built in {built:.1f} s")
    print(f"%dist_export, round trip: median {statistics.median(waited) * 1000:.0f} ms; "
          f"its own time: median {statistics.median(own) * 1000:.0f} ms (goal: within 1 s)")
    print(f"an empty cell's round trip: median {statistics.median(empty) * 1000:.0f} ms; "
          f"ratio {statistics.median(waited) / statistics.median(empty):.1f}x")


if __name__ == "__main__":
    main()
