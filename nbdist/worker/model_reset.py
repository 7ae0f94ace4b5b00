"""The user's models after a step that was stopped half-way, on a session rank.

A stop (or a raising peer) can leave a rank inside a training step: DDP's reducer expecting a
reduction that never finished, FSDP2 with some layers unsharded or an all-gather prefetched.
Each rank then starts the next step from a different state, and its collectives no longer pair
with its peers' (a hang, or gloo's "collective mismatch" abort). So after an abnormal cell the
session resets that state on *every* rank alike (:mod:`nbdist.session.recovery`): DDP's reducers, and
FSDP2's per-iteration state through its own recovery API (``FSDPModule.reset_iter_state``).
The failed iteration's gradients are lost; the parameters, the optimizer and the data stay.
DDP replicas that drifted apart (a rank took an optimizer step its peers did not) are found by
a fingerprint and named, never silently trained on.
"""

from __future__ import annotations

import sys
import weakref

import torch

__all__ = ["track_ddp_models", "track_ddp_model", "live_ddp_models", "reset_ddp_reducers", "fingerprint_ddp_models", "count_unfinished_ddp",
           "reset_fsdp_roots", "count_fsdp_roots", "reset_models"]

_DDP_MODELS: list[weakref.ref] = []  # in the order the rank built them: the same order on every rank


def track_ddp_models() -> None:
    """Remember each DDP model a session rank builds (a weak set: the user's models stay theirs).

    Scanning ``gc.get_objects()`` for them instead costs 100-200 ms per re-forming with torch loaded.
    """
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__
    if getattr(init, "_nbdist_tracked", False):
        return

    def tracked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _DDP_MODELS.append(weakref.ref(self))

    tracked_init._nbdist_tracked = True
    DistributedDataParallel.__init__ = tracked_init


def track_ddp_model(model) -> None:
    """Track a DDP model that was not built here: unpickled by the heal, in the donor's order."""
    _DDP_MODELS.append(weakref.ref(model))


def live_ddp_models() -> list:
    """This rank's DDP models, in the order they were built (the same on every rank)."""
    return _live_ddp_models()


def reset_ddp_reducers() -> int:
    """Forget every DDP model's half-done reduction, on every rank alike.

    A model interrupted between its first gradient hook and the end of backward still expects
    that reduction to finish ("Expected to have finished reduction in the prior iteration").
    Resetting also makes the reducer rebuild its buckets at the next step, which is a broadcast:
    so every rank resets every model (a reset on some ranks only would hang that broadcast).
    """
    models = _live_ddp_models()
    for model in models:
        model.reducer._reset_state()
    return len(models)


def _live_ddp_models() -> list:
    models = [ref() for ref in _DDP_MODELS]
    _DDP_MODELS[:] = [weakref.ref(m) for m in models if m is not None]
    return [m for m in models if m is not None]


def fingerprint_ddp_models() -> list[float]:
    """A float64 sum of each DDP model's parameters: replicas in step have bit-equal parameters,
    so equal sums on every rank; a rank that took one optimizer step more shows a different one."""
    with torch.no_grad():
        return [float(sum(p.detach().double().sum().item() for p in m.parameters())) for m in _live_ddp_models()]


def count_unfinished_ddp() -> int:
    """DDP models of this rank whose last backward was stopped before its reduction finished."""
    unfinished = 0
    for model in _live_ddp_models():
        try:
            model.reducer._check_reducer_finalized()
        except RuntimeError:
            unfinished += 1
    return unfinished


def _fsdp_roots() -> list:
    """The root FSDP2 modules of this rank that have run (torch keeps every composable module's
    state in one weak map: no scan of the heap)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return []  # no FSDP2 model can exist; importing it to look would cost a stop 0.6 s
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    roots = []
    for module, ref in list(_module_state_mapping.items()):
        state = ref() if isinstance(ref, weakref.ref) else ref
        if isinstance(module, FSDPModule) and getattr(state, "_is_root", None):
            roots.append(module)
    return roots


def count_fsdp_roots() -> int:
    """How many FSDP2 root modules this rank has (each is reset after an abnormal cell)."""
    return len(_fsdp_roots())


def reset_fsdp_roots() -> int:
    """FSDP2's own recovery after an exception mid-forward or mid-backward, on every root module.

    A pending all-gather of a group that was released or cut fails when waited on: it is
    forgotten first (its result is of no use), then the reset runs again.
    """
    roots = _fsdp_roots()
    for root in roots:
        if not hasattr(root, "reset_iter_state"):
            import torch

            raise RuntimeError(f"an FSDP2 model is kept across a stopped or failed step from torch 2.13 on "
                               f"(FSDPModule.reset_iter_state); this rank has torch {torch.__version__}")
        try:
            root.reset_iter_state()
        except Exception:
            for group in _param_groups(root):
                group._all_gather_result = None
            root.reset_iter_state()
        _reshard_every_param(root)
    return len(roots)


def _param_groups(root) -> list:
    return [group for state in root._get_fsdp_state()._state_ctx.all_states for group in state._fsdp_param_groups]


def _reshard_every_param(root) -> None:
    """Every parameter back to its shard, whatever its group believes.

    ``reset_iter_state`` reshards a group only when the group's own state says it is not sharded.
    The stop button is a KeyboardInterrupt that can land between any two bytecodes, also inside
    FSDP2's loop that unshards a group's parameters one by one before it records the group as
    unsharded: a parameter is then left unsharded in a group that says "sharded", and the next
    forward fails its check ("Expects to be in one of (SHARDED, ...), not UNSHARDED").
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    for group in _param_groups(root):
        for param in group.fsdp_params:
            if param.sharded_state != ShardedState.SHARDED:
                param.to_sharded()
        group._sharded_state = ShardedState.SHARDED


def reset_models() -> dict:
    """Reset every half-done step, on every rank alike: ``{"ddp_models": n, "fsdp_roots": m}``."""
    return {"ddp_models": reset_ddp_reducers(), "fsdp_roots": reset_fsdp_roots()}
