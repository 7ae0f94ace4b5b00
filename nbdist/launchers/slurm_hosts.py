"""Slurm host lists (``SLURM_STEP_NODELIST``, ``SLURM_JOB_NODELIST``) as the hosts they name.

Slurm writes a step's nodes compressed: ``gpu[03-05,07],cpu1``, ``rack[1-2]-node[01-04]``. Slurm's
own ``scontrol show hostnames`` expands them exactly as Slurm means them, and is used where it is
installed (every Slurm node has it). Elsewhere (a kernel that only sees the variables, a test) a
parser reads the same grammar: comma-separated names outside brackets, each name any number of
bracket groups, each group a comma-separated list of numbers and ``lo-hi`` ranges whose width
(``01``) is kept. Several groups in one name multiply out, the leftmost varying slowest, as Slurm
does it.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess

__all__ = ["expand_hostlist", "parse_hostlist", "first_slurm_host"]

SCONTROL_TIMEOUT_S = 5.0


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``"gpu[03-05,07],cpu1"`` -> ``"gpu03"``."""
    hosts = expand_hostlist(nodelist)
    if not hosts:
        raise ValueError(f"the Slurm node list {nodelist!r} names no host")
    return hosts[0]


def expand_hostlist(nodelist: str) -> list[str]:
    """Every host of ``nodelist``, in Slurm's order: from ``scontrol show hostnames`` where Slurm
    is installed, else from :func:`parse_hostlist`."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=SCONTROL_TIMEOUT_S, check=True).stdout.split()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass  # a Slurm that can't answer (no controller config here): the parser reads the same grammar
    return parse_hostlist(nodelist)


def parse_hostlist(nodelist: str) -> list[str]:
    """Expand a Slurm host list without Slurm. Raises ValueError on an unbalanced bracket or a
    range that runs backwards."""
    return [host for name in _split_outside_brackets(nodelist.strip(), ",") if name for host in _expand_name(name)]


def _split_outside_brackets(text: str, sep: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested brackets in the Slurm host list {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"an unbalanced ']' in the Slurm host list {text!r}")
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"an unclosed '[' in the Slurm host list {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts]


def _expand_name(name: str) -> list[str]:
    """``rack[1-2]-node[01-02]`` -> rack1-node01, rack1-node02, rack2-node01, rack2-node02."""
    pieces: list[list[str]] = []
    rest = name
    while "[" in rest:
        before, _, after = rest.partition("[")
        inside, _, rest = after.partition("]")
        pieces.append([before])
        pieces.append(_expand_group(inside, name))
    pieces.append([rest])
    return ["".join(combo) for combo in itertools.product(*pieces)]


def _expand_group(group: str, name: str) -> list[str]:
    out = []
    for item in group.split(","):
        lo, dash, hi = item.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{item!r} in the Slurm host list name {name!r} is not a number or a range")
        if not dash:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"the range {item!r} in the Slurm host list name {name!r} runs backwards")
        width = len(lo)  # Slurm keeps the lower bound's zero padding: node[08-10] -> node08, node09, node10
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out
