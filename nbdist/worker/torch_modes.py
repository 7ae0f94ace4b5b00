"""Torch's thread-global modes as a cell found them, put back after a stop.

The stop button reaches a busy rank as a signal, and Python raises its KeyboardInterrupt between any
two bytecodes: also inside a ``finally`` or an ``__exit__`` that was about to restore a mode. torch's
optimizers run their step under ``torch.set_grad_enabled(False)`` and restore it in a ``finally``; a
stop that lands there leaves grad mode off, and the rank's next training step fails with "element 0
of tensors does not require grad". So before each cell a rank notes grad mode, inference mode and
autocast (per device type: enabled, dtype; the cache flag and the nesting depth), and after a stop it
puts back whatever differs, saying what it did. A cell that changed a mode itself and was then stopped
gets it back too, as if its ``with`` block had ended. Nothing is touched after a cell that finished or
raised (an exception raised by the code unwinds its ``with`` blocks as any exception does).

Nothing here imports torch: a rank that never imported it has no modes to keep.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["TorchModes", "note_modes", "restore_modes"]

AUTOCAST_DEVICES = ("cpu", "cuda")
_HELD: list = []  # inference-mode guards entered to turn a stuck one off: never exited, so never undone


@dataclass(frozen=True)
class TorchModes:
    """The thread-global modes of torch on a rank's main thread, at one moment."""

    grad: bool
    inference: bool
    autocast: tuple  # ((device type, enabled, dtype), ...)
    autocast_cache: bool
    autocast_nesting: int


def note_modes() -> TorchModes | None:
    """The modes now (None where torch was never imported: nothing to keep)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "is_grad_enabled"):
        return None
    nesting = torch.autocast_increment_nesting() - 1  # torch has no getter: up one, and back
    torch.autocast_decrement_nesting()
    return TorchModes(
        grad=torch.is_grad_enabled(),
        inference=torch.is_inference_mode_enabled(),
        autocast=tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES),
        autocast_cache=torch.is_autocast_cache_enabled(),
        autocast_nesting=nesting,
    )


def restore_modes(found: TorchModes | None) -> list[str]:
    """Put back the modes that differ from ``found``; return what was put back, in words (empty when
    nothing differed)."""
    now = note_modes()
    if found is None or now is None or now == found:
        return []
    import torch

    said = []
    if now.inference != found.inference:
        guard = torch._C._InferenceMode(found.inference)
        guard.__enter__()  # the guard left open by the stop is gone with its frame; this one stays
        _HELD.append(guard)
        said.append(f"inference mode {'on' if found.inference else 'off'}")
    if now.grad != found.grad:  # (leaving inference mode may have put it back already)
        said.append(f"grad mode {'on' if found.grad else 'off'}")
    if torch.is_grad_enabled() != found.grad:
        torch.set_grad_enabled(found.grad)
    for (device, enabled, dtype), (_, was_enabled, was_dtype) in zip(found.autocast, now.autocast):
        if (enabled, dtype) != (was_enabled, was_dtype):
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
            said.append(f"autocast on {device} {'on, ' + str(dtype).replace('torch.', '') if enabled else 'off'}")
    if now.autocast_cache != found.autocast_cache:
        torch.set_autocast_cache_enabled(found.autocast_cache)
    depth = now.autocast_nesting
    while depth > found.autocast_nesting:
        depth = torch.autocast_decrement_nesting()
        if depth == 0:
            torch.clear_autocast_cache()  # as autocast's own exit does at the outermost level
    while depth < found.autocast_nesting:
        depth = torch.autocast_increment_nesting()
    return said
