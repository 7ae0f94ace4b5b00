"""How many optimizer steps each of a session rank's optimizers took in the last user cell.

After a stop, replicas drift when one rank's optimizer took a step that its peers did not. DDP
replicas show it in their parameters (:func:`nbdist.worker.model_reset.fingerprint_ddp_models`);
FSDP2 shards differ by design, so only the steps can tell. torch calls global optimizer hooks
around every ``Optimizer.step`` of every optimizer (``register_optimizer_step_pre_hook`` and
``..._post_hook``): counting there costs two Python calls per step and needs no handle on the
user's optimizers. The counts are per cell (a ``--ranks`` cell may step some ranks on purpose),
and a rank stopped inside a step (its post hook never ran) says so: its update is half applied.
"""

from __future__ import annotations

import weakref

__all__ = ["track_optimizer_steps", "begin_user_cell", "steps_this_cell", "numbering", "adopt_numbering"]

_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> _Count
_FIRST: list = [0]  # how many optimizers stepped so far: the next one's number
_TRACKING: list = []  # the hooks' handles, once


class _Count:
    __slots__ = ("number", "steps", "at_cell_start", "inside")

    def __init__(self, number: int):
        self.number, self.steps, self.at_cell_start, self.inside = number, 0, 0, False


def track_optimizer_steps() -> None:
    """Count every optimizer's steps on this rank from now on (once per process)."""
    if _TRACKING:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    _TRACKING.extend([register_optimizer_step_pre_hook(_before_step), register_optimizer_step_post_hook(_after_step)])


def _count_of(optimizer) -> _Count:
    count = _STEPS.get(optimizer)
    if count is None:  # numbered as first stepped: the same order on every rank of an SPMD program
        _FIRST[0] += 1
        count = _STEPS[optimizer] = _Count(_FIRST[0])
    return count


def _before_step(optimizer, args, kwargs) -> None:
    _count_of(optimizer).inside = True


def _after_step(optimizer, args, kwargs) -> None:
    count = _count_of(optimizer)
    count.steps += 1
    count.inside = False


def numbering(optimizers: dict) -> tuple[dict, int]:
    """On a heal's donor: ``({name: number}, numbers given so far)`` of the ``{name: optimizer}`` it
    gives, so the new rank numbers them (and the next one) as every rank does."""
    return {name: _STEPS[opt].number for name, opt in optimizers.items() if opt in _STEPS}, _FIRST[0]


def adopt_numbering(optimizers: dict, numbers: dict, given: int) -> None:
    """On the new rank: the donor's numbers for the optimizers it copied (see :func:`numbering`)."""
    for name, number in numbers.items():
        if name in optimizers:
            _STEPS[optimizers[name]] = _Count(number)
    _FIRST[0] = max(_FIRST[0], given)


def begin_user_cell() -> None:
    """A user's cell starts: its steps are counted from here."""
    for count in list(_STEPS.values()):
        count.at_cell_start, count.inside = count.steps, False


def steps_this_cell() -> dict[int, tuple[int, bool]]:
    """``{optimizer number: (steps in the last user cell, stopped inside a step)}`` of the optimizers
    that stepped in it (numbered as first stepped on this rank)."""
    return {c.number: (c.steps - c.at_cell_start, c.inside) for c in list(_STEPS.values())
            if c.steps != c.at_cell_start or c.inside}
