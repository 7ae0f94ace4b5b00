"""The text view: rank-prefixed lines for terminal IPython, nbconvert and logs."""

from __future__ import annotations

import sys

from nbdist.frontend.views.buffer import FELL_BEHIND, BufferedView, format_report_line
from nbdist.frontend.views.cell_output import show_in_cell

__all__ = ["TextView"]


class TextView(BufferedView):
    """Rank-prefixed lines for terminal IPython, nbconvert and logs. A ``\\r`` line (a tqdm bar)
    is printed once, in its final state, when it ends."""

    def __init__(self, run, stream=None):
        super().__init__(run)
        self.stream = stream or sys.stdout
        self._announced = set()
        run.subscribe(self.on_event)

    def flush(self, final: bool = False) -> None:
        lines, pending, _ = self.take()
        out = []
        for rank in sorted(lines):
            for stream, line in lines[rank]:
                out.append(f"[rank {rank}{'!' if stream == 'stderr' else ''}] {line}\n")
        taken = self.take_displays()
        for rank in sorted(taken.dropped):
            out.append(f"[rank {rank}!] {taken.dropped_note(rank, FELL_BEHIND)}\n")
        for shown in taken.events:
            if shown.rank == self._first_rank() and self._in_cell and show_in_cell(shown):
                continue  # rank 0's rich output is the cell's own, as it would be in the kernel
            out.append(f"[rank {shown.rank}] {shown.data.get('text/plain', '<rich output>')}\n")
        if final and not (self.run.status == "finished" and self.run.quiet_when_finished):
            out.append(f"nbdist: {format_report_line(self.run)}  (logs: {self.run.log_dir})\n")
        if out:
            self.stream.write("".join(out))
            self.stream.flush()

    def _first_rank(self) -> int:
        return min(self.run.global_rank(r) for r in self.run.ranks)


