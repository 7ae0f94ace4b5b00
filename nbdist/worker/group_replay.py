"""The groups a session's ranks made, recorded so that a healed rank makes the same ones, in order.

torch names a group by a counter that every rank bumps on every ``new_group`` call (members or
not), and a group's store prefix is its name: a rank that joins later must make the same calls in
the same order, or its groups would meet no one. So every session rank records each call to
``distributed_c10d._new_group_with_tag`` (what ``new_group`` and a ``DeviceMesh`` both go through),
and the heal replays the donor's record on the new rank (:func:`replay_groups`) while the survivors
re-form theirs under the same generation.

A value that holds a group (``sub = dist.new_group([0, 2])``) is pickled as a reference to the
group's name (:func:`group_reference`) and found again on the new rank by that name
(:func:`resolve_group`).
"""

from __future__ import annotations

__all__ = ["record_group_calls", "recorded_groups", "replay_groups", "group_reference", "resolve_group",
           "unreplayable", "group_fingerprint", "made_group", "call_index", "nearest_call", "NOT_A_MEMBER"]

_RECORD: list[dict] = []  # each new group's arguments, in the order this rank made them
_MADE: list = []  # what each of those calls returned here: the group, or NON_GROUP_MEMBER (-100)
NOT_A_MEMBER = "process group: this rank is not a member"  # the fingerprint of torch's NON_GROUP_MEMBER
_REFERENCE = "nbdist-process-group"


def record_group_calls() -> None:
    """From now on, remember the arguments of every group this rank makes (once per process)."""
    import torch.distributed.distributed_c10d as c10d

    made = c10d._new_group_with_tag
    if getattr(made, "_nbdist_recorded", False):
        return

    def recorded(ranks=None, timeout=None, backend=None, backend_options=None, pg_tag=None,
                 use_local_synchronization=False, group_desc=None, device_id=None, sort_ranks=True):
        call = {"ranks": list(ranks) if ranks is not None else None, "timeout": timeout, "backend": backend,
                "backend_options": backend_options, "pg_tag": pg_tag,
                "use_local_synchronization": use_local_synchronization, "group_desc": group_desc,
                "device_id": device_id, "sort_ranks": sort_ranks}
        group = made(**call)
        _RECORD.append(call)
        _MADE.append(group)
        return group

    recorded._nbdist_recorded, recorded._nbdist_made = True, made
    c10d._new_group_with_tag = recorded


def recorded_groups() -> list[dict]:
    """On the donor: what it made, for the new rank to make the same (the heal writes it for it)."""
    return [dict(call) for call in _RECORD]


def unreplayable(calls: list[dict], dead: set[int]) -> list[str]:
    """Groups of ``calls`` that a replacement for ``dead`` could not re-join: an explicit backend
    (not re-formable, so the survivors can't connect it again), of which a dead rank is a member."""
    out = []
    for call in calls:
        members = set(call["ranks"]) if call["ranks"] else None
        if call["backend"] not in (None, "nbdist") and (members is None or members & dead):
            out.append(f"a group of ranks {sorted(members) if members else 'all'} made with backend={call['backend']!r}")
    return out


def replay_groups(calls: list[dict]) -> int:
    """On the new rank, right after its default group: make the donor's groups, in its order."""
    import torch.distributed.distributed_c10d as c10d

    made = getattr(c10d._new_group_with_tag, "_nbdist_made", c10d._new_group_with_tag)
    for call in calls:
        group = made(**call)
        _RECORD.append(dict(call))
        _MADE.append(group)
    return len(calls)


def group_fingerprint(value) -> str | None:
    """``"process group #k"`` for a group this rank made with its k-th call (the same k on every rank),
    :data:`NOT_A_MEMBER` for torch's stand-in on a rank outside it, None for anything else."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    if isinstance(value, dist.ProcessGroup):
        index = call_index(value)
        return f"process group #{index}" if index is not None else f"process group {value.group_name}"
    if type(value) is int and value == dist.GroupMember.NON_GROUP_MEMBER:
        return NOT_A_MEMBER
    return None


def call_index(group) -> int | None:
    """The index of the call that made ``group`` on this rank (None: not one nbdist saw made)."""
    return next((k for k, g in enumerate(_MADE) if g is group), None)


def nearest_call(ranks: list[int], near: int) -> int | None:
    """The index of this rank's call that made a group of ``ranks``, nearest to ``near`` (a mesh's
    groups are made in a run of calls, one per row; the same members may recur elsewhere)."""
    want = sorted(ranks)
    found = [k for k, call in enumerate(_RECORD) if call["ranks"] is not None and sorted(call["ranks"]) == want]
    return min(found, key=lambda k: abs(k - near)) if found else None


def made_group(index: int):
    """This rank's result of its ``index``-th group call: the group, or NON_GROUP_MEMBER."""
    return _MADE[index]


def group_reference(obj):
    """A pickler's ``persistent_id``: a process group travels as its name, not as itself."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(obj, dist.ProcessGroup):
        return (_REFERENCE, obj.group_name)
    return None


def resolve_group(pid):
    """An unpickler's ``persistent_load``: this rank's group of the name the donor's had."""
    kind, name = pid
    if kind != _REFERENCE:
        raise ValueError(f"unknown persistent id {pid!r}")
    import torch.distributed.distributed_c10d as c10d

    return c10d._resolve_process_group(name)
