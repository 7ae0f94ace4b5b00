"""What a stopped or failed cell says about the replicas: where they stopped, and whether they differ.

Two facts come from the ranks after the cell (:func:`nbdist.worker.session_loop.count_collectives`):
each DDP model's fingerprint (replicas in step have bit-equal parameters) and how many steps each
optimizer took in the cell (FSDP2's shards differ by design; only its steps can tell a drift).
A rank that took a step its peers did not, or was stopped inside one, is named, and the note offers
``%dist_sync``. Ranks stopped at the agreed point can't differ; one that the deadline stopped where
it was may, and is named too.
"""

from __future__ import annotations

from nbdist.errors import format_rank_set

__all__ = ["describe_stop_point", "describe_drift", "describe_sync", "SYNC_HINT"]

SYNC_HINT = ("%dist_sync re-syncs DDP replicas and their optimizers from rank 0 (--from R; Session.sync() "
             "in code)")


def describe_stop_point(stopped_before: dict, anywhere: list, behind: list, window: float | None) -> str:
    """``ranks 0-1 stopped before all_reduce #57 on the default group, the point they agreed on;
    rank 2 did not reach it within 0.3 s and was stopped where it was``. ``anywhere``: the ranks
    still busy when the window closed; ``behind``: those of them that had not reached the point."""
    parts, by_point = [], {}
    for rank, where in sorted(stopped_before.items()):
        by_point.setdefault(where, []).append(rank)
    for where, ranks in by_point.items():
        parts.append(f"{format_rank_set(ranks)} stopped before {where}")
    if by_point:
        parts[-1] += ", the point they agreed on" if len(by_point) == 1 else ", the points they agreed on"
    if window is not None and (behind or anywhere):
        late = behind or anywhere
        one = len(late) == 1
        what = "did not reach it" if behind else "reached no further collective"
        parts.append(f"{format_rank_set(late)} {what} within {window:.2g} s and {'was' if one else 'were'} "
                     f"stopped where {'it was' if one else 'they were'}")
    return "; ".join(parts)


def describe_drift(prints: dict, steps: dict, anywhere: list) -> str:
    """What differs between the ranks now; ``prints``: ``{rank: [DDP fingerprint, ...]}``,
    ``steps``: ``{rank: {optimizer: (steps, inside)}}``; ``anywhere``: ranks stopped where they
    were. Empty when nothing differs and nothing may."""
    said = [*_ddp_differs(prints), *_steps_differ(steps)]
    if said:
        return "; ".join(said) + f": {SYNC_HINT}"
    if anywhere and (any(prints.values()) or any(steps.values())):
        return (f"the DDP replicas and optimizer steps match on every rank, though "
                f"{format_rank_set(anywhere)} stopped mid-cell")
    return ""


def _ddp_differs(prints: dict) -> list[str]:
    models = max((len(p) for p in prints.values()), default=0)
    differ = [i for i in range(models) if len({p[i] if i < len(p) else None for p in prints.values()}) > 1]
    if not differ:
        return []
    which = ", ".join(f"#{i + 1}" for i in differ)
    return [f"the replicas of DDP model {which} (in the order the cells built them) now differ between ranks"]


def _steps_differ(steps: dict) -> list[str]:
    numbers = sorted({n for s in steps.values() for n in s})
    said = []
    for number in numbers:
        taken = {rank: s.get(number, (0, False)) for rank, s in steps.items()}
        inside = [r for r, (_, i) in sorted(taken.items()) if i]
        by_count: dict = {}
        for rank, (count, _) in sorted(taken.items()):
            by_count.setdefault(count, []).append(rank)
        if len(by_count) > 1:
            counts = ", ".join(f"{c} on {format_rank_set(r)}" for c, r in sorted(by_count.items(), reverse=True))
            said.append(f"optimizer #{number} took a different number of steps in the cell ({counts})")
        if inside:
            said.append(f"{format_rank_set(inside)} {'was' if len(inside) == 1 else 'were'} stopped inside "
                        f"optimizer #{number}'s step (its update is half applied)")
    return said


def describe_sync(result: dict) -> str:
    """One line for the notebook about a :func:`nbdist.worker.replica_sync.sync_replicas` result (its keys may have become strings)."""
    if not result["models"]:
        return ("no DDP model on the ranks: nothing to re-sync "
                "(FSDP2 shards differ by design; restore those from a checkpoint)")
    line = f"re-synced {_pluralize(result['models'], 'DDP model')} ({result['tensors']} tensors, " \
           f"{_format_bytes(result['bytes'])}) and "
    if result["optimizers"]:
        given = sorted((int(rank), n) for rank, n in result["given_state"].items())
        line += f"{_pluralize(result['optimizers'], 'optimizer')} ({result['state_tensors']} state tensors"
        if given:
            line += (f"; rank{'s' * (len(given) > 1)} {', '.join(str(r) for r, _ in given)} had no state for "
                     f"{', '.join(str(n) for _, n in given)} parameter{'s' * (given[-1][1] > 1)} and got it")
        line += ")"
    else:
        line += "no optimizer"
    seconds = result["seconds"]
    line += f" from rank {result['src']} in " + (f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s")
    if result["skipped_optimizers"]:
        line += f"; {_pluralize(result['skipped_optimizers'], 'optimizer')} of other parameters left as they are"
    return line


def _pluralize(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _format_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
