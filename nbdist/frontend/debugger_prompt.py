"""The notebook's side of pdb in session ranks: a prompt in the stdin box for each stopped rank.

A rank stopped in ``breakpoint()`` (or in ``%dist_debug``'s post-mortem) waits for a command
(:mod:`nbdist.worker.debugger`). While a cell's ranks wait, the kernel's main thread, which waits
for the cell anyway, prints what pdb printed and asks through ``input()``: the stdin box that
JupyterLab, Notebook 7, VS Code and terminal IPython show (``input_request``). Besides pdb's own
commands:

- ``ranks``: the stopped ranks, where each stands;
- ``rank N``: talk to rank N;
- ``all CMD``: send CMD to every stopped rank (``all c`` lets them all go on);
- ``q``: the stop button: debugging ends and the cell is interrupted, the ranks' state kept.

Ranks that didn't stop are not touched; the cell goes on once every stopped rank went on.
"""

from __future__ import annotations

import builtins

__all__ = ["answer_debug_prompts", "HELP"]

HELP = "nbdist: ranks | rank N | all CMD | q (stops the cell); the rest goes to pdb"
_QUIT = ("q", "quit", "exit")
_AFTER_COMMAND_S = 2.0  # how long a command may take to give its next prompt before the cell view takes over


def answer_debug_prompts(cell, ask=None, before_prompt=lambda: None) -> None:
    """While ranks of ``cell`` wait in pdb, prompt the user and pass the commands on; return when
    none waits. KeyboardInterrupt (the stop button, or ``q``) propagates: the caller stops the cell.
    ``before_prompt`` runs before each prompt (the view draws its badges)."""
    ask = ask or builtins.input
    current, told = None, set()
    placed = None  # the (rank, where) the last "stopped at" line named
    while True:
        with cell.debug_changed:
            paused = dict(cell.paused)
            resumed, cell.resumed_text = cell.resumed_text, {}
        for rank, text in sorted(resumed.items()):
            _show(text)
        if not paused or cell.done:
            return
        if current not in paused:
            current = min(paused)
        stop = paused[current]
        if stop.number not in told:  # each prompt's output once, however often the user switches
            told.add(stop.number)
            # Which rank speaks, where several are stopped: said when it changes (a switch, or a
            # step that moved it), not after every command typed to the same rank.
            if (len(paused) > 1 or current != min(paused)) and placed != (current, stop.where):
                print(f"nbdist: rank {current} stopped at {stop.where}")
                placed = (current, stop.where)
            _show(stop.text)
        before_prompt()
        try:
            line = ask(f"(Pdb rank {current}) ")
        except (EOFError, NotImplementedError) as exc:  # no stdin after all (StdinNotImplementedError)
            _go_on_without_stdin(cell, paused, exc)
            return
        command = line.strip()
        if command == "ranks":
            print("\n".join(f"  rank {r}: {s.where}{'   <- current' if r == current else ''}"
                            for r, s in sorted(paused.items())))
            continue
        if command.startswith("rank ") and command[5:].strip().isdigit():
            wanted = int(command[5:])
            if wanted in paused:
                current = wanted
                told.discard(paused[wanted].number)  # show where it is
            else:
                print(f"nbdist: rank {wanted} is not stopped in the debugger (stopped: "
                      f"{', '.join(map(str, sorted(paused)))})")
            continue
        if command in ("help nbdist", "nbdist"):
            print(HELP)
            continue
        if command in _QUIT:
            raise KeyboardInterrupt("q: debugging ends, the cell is stopped")
        targets = sorted(paused) if command.startswith("all ") else [current]
        _send(cell, targets, command[4:] if command.startswith("all ") else line.rstrip("\n"))


def _send(cell, ranks, command: str) -> None:
    """Pass ``command`` to ``ranks``, then wait (a little) for each to ask again or to go on."""
    with cell.debug_changed:
        stops = {r: cell.paused.pop(r) for r in ranks if r in cell.paused}
    cell.incarnation.send(list(stops), ("debug_reply", cell.cell_id, command))
    with cell.debug_changed:
        cell.debug_changed.wait_for(lambda: cell.done or all(r in cell.paused or r in cell.resumed_text for r in stops),
                                    timeout=_AFTER_COMMAND_S)


def _go_on_without_stdin(cell, paused: dict, exc: BaseException) -> None:
    print(f"nbdist: {len(paused)} rank(s) reached a breakpoint, but this front end has no stdin "
          f"({type(exc).__name__}); the ranks go on")
    cell.stdin = False
    _send(cell, sorted(paused), "continue")


def _show(text: str) -> None:
    if text:
        print(text, end="" if text.endswith("\n") else "\n")
