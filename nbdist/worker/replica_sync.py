"""Re-syncing a session's DDP replicas and their optimizers from one rank, on every rank alike.

A stop, or a ``--ranks`` cell, can leave replicas different: a rank took an optimizer step that
its peers did not. DDP broadcasts the parameters only when it is built, so training on would
average the gradients of different models for good. This module copies one rank's parameters,
buffers and optimizer state onto every replica, in place: the objects the user's code holds stay
the same. The models are those :mod:`nbdist.worker.model_reset` tracks; FSDP2 shards differ by
design and are left to a checkpoint. The ranks' descriptions are checked on every rank alike
first, so a mismatch raises everywhere before any tensor moves (an error on some ranks only would
leave the others waiting in a broadcast for good).
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

from nbdist.worker.model_reset import _live_ddp_models
from nbdist.worker.signed_collectives import agree_key, all_gather_signed, broadcast_signed

__all__ = ["sync_replicas"]

_UNCHANGED = "; nothing was re-synced"



def _session_key() -> bytes | None:
    """The key of the session this rank serves, or None outside one."""
    import os

    from nbdist.protocol.rundir import RUN_DIR_ENV
    from nbdist.protocol.session_channel import read_session_key

    try:
        return read_session_key((os.environ.get(RUN_DIR_ENV) or "").rstrip()) or None
    except OSError:
        return None

def sync_replicas(src: int = 0) -> dict:
    """Make every DDP replica and its optimizers equal to rank ``src``'s; collective, on every rank alike.

    Parameters
    ----------
    src : int
        The global rank whose models and optimizers the others take.

    Returns
    -------
    dict
        The same on every rank (for :func:`nbdist.session.replica_check.describe_sync`): ``src``,
        ``models``, ``tensors``, ``bytes``,
        ``optimizers``, ``state_tensors``, ``state_bytes``, ``given_state`` (rank -> parameters that got
        state they lacked), ``skipped_optimizers`` (of no DDP model, left alone), ``seconds`` (src's).

    Raises
    ------
    ValueError
        ``src`` is no rank of the world, or no member of some model's process group.
    RuntimeError
        The ranks' models or optimizers differ in structure; nothing has been changed then.
    """
    started = time.perf_counter()
    world, rank = dist.get_world_size(), dist.get_rank()
    if not 0 <= src < world:
        raise ValueError(f"src={src} is not a rank of this world of {world} ranks")
    models = _live_ddp_models()
    tensors = [_list_model_tensors(model) for model in models]
    optimizers, skipped = _find_optimizers(tensors)
    # Signed with the session's key: a peer's bytes are checked before anything of them is unpickled.
    key = agree_key(_session_key())
    round_ = f"sync/{time.time_ns()}" if rank == src else None
    round_ = broadcast_signed(round_, key=key, topic="sync/round", src=src)
    descriptions = all_gather_signed(_describe(src, models, tensors, optimizers, skipped), key=key,
                                     topic=f"{round_}/describe")
    _check_models(descriptions, src)
    given = _check_optimizers(descriptions, src)
    # Every rank passed the same checks on the same descriptions: from here on none raises alone.
    plan, groups = descriptions[src]["optimizers"], [model.process_group for model in models]
    with torch.no_grad():
        _fit_state(optimizers, plan, tensors)
        model_jobs = [(t, group, t.device) for group, (params, buffers) in zip(groups, tensors)
                      for _, t in params + buffers]
        # (tensor, group, its parameter's device) for every state tensor, in src's order
        state_jobs = [(optimizer.state[tensors[i][0][j][1]][key], groups[i], tensors[i][0][j][1].device)
                      for (i, _, optimizer), spec in zip(optimizers, plan)
                      for j, entries in spec["state"].items() for key, entry in entries.items() if entry[0] == "tensor"]
        _finish_broadcasts(_issue_broadcasts(model_jobs + state_jobs, src))
        sent = [broadcast_signed(_collect_settings(optimizers, plan, tensors, time.perf_counter() - started)
                                 if rank == src else None, key=key, topic=f"{round_}/settings", src=src)]
        if rank != src:
            _apply_settings(optimizers, tensors, sent[0]["optimizers"])
    return {"src": src, "models": len(models), "tensors": len(model_jobs), "bytes": _count_bytes(model_jobs),
            "optimizers": len(optimizers), "state_tensors": len(state_jobs), "state_bytes": _count_bytes(state_jobs),
            "given_state": given, "skipped_optimizers": descriptions[src]["skipped"], "seconds": sent[0]["seconds"]}


def _list_model_tensors(model) -> tuple[list, list]:
    """A DDP model's ``(name, tensor)`` parameters and buffers; those the user told DDP to ignore are
    rank-local by their choice and stay so (DDP's own ignore set also holds its delayed, replicated ones)."""
    ignored = set(getattr(model.module, "_ddp_params_and_buffers_to_ignore", ()))
    return ([(n, p) for n, p in model.module.named_parameters() if n not in ignored],
            [(n, b) for n, b in model.module.named_buffers() if n not in ignored])


def _find_optimizers(tensors: list) -> tuple[list, int]:
    """This rank's optimizers of one DDP model each, as ``(model index, param indices per group, optimizer)``
    in an order that is the same on every rank; and how many other optimizers were left alone."""
    owner = {}
    for i, (params, _) in enumerate(tensors):
        for j, (_, param) in enumerate(params):
            owner.setdefault(id(param), (i, j))
    # A scan of the heap costs tens of ms with torch loaded, but a re-sync is a rare command the user
    # asks for; the step hooks (optimizer_steps) see only optimizers that stepped, not one made since.
    gc.collect()  # an optimizer that the user replaced but a reference cycle still holds is no one's
    found, skipped = [], 0
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.optim.Optimizer):  # type(): no odd object's __class__ runs
            continue
        places = [[owner.get(id(p)) for p in group["params"]] for group in getattr(obj, "param_groups", [])]
        model_of = {place[0] if place else None for group in places for place in group}
        if len(model_of) != 1 or None in model_of:
            skipped += 1
            continue
        found.append((model_of.pop(), [[place[1] for place in group] for group in places], obj))
    # gc's order differs between ranks: the optimizers are paired by what they hold instead.
    found.sort(key=lambda f: (f[0], min(j for g in f[1] for j in g), sum(map(len, f[1])), f[1], type(f[2]).__name__))
    return found, skipped


def _describe(src: int, models: list, tensors: list, optimizers: list, skipped: int) -> dict:
    """What this rank has, to compare with its peers': shapes and kinds, no data."""
    def spec(name, t):
        return name, tuple(t.shape), str(t.dtype).removeprefix("torch.")

    return {"src": src, "skipped": skipped,
            "models": [{"group": _get_group_ranks(model.process_group), "params": [spec(*nt) for nt in params],
                        "buffers": [spec(*nt) for nt in buffers]} for model, (params, buffers) in zip(models, tensors)],
            "optimizers": [_describe_optimizer(i, groups, opt, tensors[i][0]) for i, groups, opt in optimizers]}


def _get_group_ranks(group) -> list | None:
    try:
        return dist.get_process_group_ranks(group)
    except Exception:  # raising here, on this rank only, would leave its peers in the all-gather
        return None


def _describe_optimizer(model: int, groups: list, optimizer, params: list) -> dict:
    """Per parameter with state, each entry as ``("tensor", shape, dtype, on the param's device type)``
    or ``("value", type name)`` (values are sent, not compared: they only have to be values on both)."""
    state = {}
    for j in (j for group in groups for j in group):
        param, entries = params[j][1], optimizer.state.get(params[j][1])
        if entries:
            state[j] = {key: ("tensor", tuple(v.shape), str(v.dtype).removeprefix("torch."),
                              v.device.type == param.device.type) if torch.is_tensor(v) else ("value", type(v).__name__)
                        for key, v in entries.items()}
    return {"model": model, "kind": type(optimizer).__name__, "groups": groups, "state": state}


def _check_models(descriptions: list, src: int) -> None:
    """Raise the same error on every rank where the models can't be paired with src's tensor by tensor."""
    if len({d["src"] for d in descriptions}) > 1:
        raise RuntimeError(f"the ranks asked to re-sync from different ranks: {[d['src'] for d in descriptions]}"
                           f"{_UNCHANGED}")
    ours = descriptions[src]["models"]
    for rank, desc in enumerate(descriptions):
        if len(desc["models"]) != len(ours):
            raise RuntimeError(f"rank {rank} has {len(desc['models'])} DDP models, rank {src} has {len(ours)}: "
                               f"replicas are paired in the order they were built{_UNCHANGED}")
        for i, (a, b) in enumerate(zip(ours, desc["models"])):
            if b["group"] is None or src not in b["group"]:
                over = "a group whose ranks torch does not know" if b["group"] is None else f"ranks {b['group']}"
                raise ValueError(f"DDP model #{i + 1} on rank {rank} is replicated over {over}, which rank {src} "
                                 f"is not one of: re-sync it from one of its own ranks{_UNCHANGED}")
            differs = (f"it is replicated over ranks {b['group']} there, over {a['group']} on rank {src}"
                       if a["group"] != b["group"]
                       else _find_first_difference(a["params"], b["params"], "parameter", src)
                       or _find_first_difference(a["buffers"], b["buffers"], "buffer", src))
            if differs:
                raise RuntimeError(f"DDP model #{i + 1} differs on rank {rank}: {differs}{_UNCHANGED}")


def _find_first_difference(ours: list, theirs: list, what: str, src: int) -> str | None:
    for a, b in zip(ours, theirs):
        if a != b:
            return f"{what} {b[0]!r} is {b[2]} {list(b[1])} there, rank {src} has {what} {a[0]!r} {a[2]} {list(a[1])}"
    return f"{len(theirs)} {what}s there, {len(ours)} on rank {src}" if len(ours) != len(theirs) else None


def _check_optimizers(descriptions: list, src: int) -> dict:
    """Raise the same error on every rank where the optimizers can't be paired with src's; return
    rank -> how many parameters have no state there that src has state for (they get it)."""
    ours, given = descriptions[src]["optimizers"], {}
    for rank, desc in enumerate(descriptions):
        if len(desc["optimizers"]) != len(ours):
            raise RuntimeError(f"rank {rank} has {len(desc['optimizers'])} optimizers of DDP models' parameters, "
                               f"rank {src} has {len(ours)} (one the notebook still references counts, an old one "
                               f"replaced by a new one too){_UNCHANGED}")
        for k, (a, b) in enumerate(zip(ours, desc["optimizers"])):
            label = f"optimizer #{k + 1} ({a['kind']} of DDP model #{a['model'] + 1})"
            differs = (f"it holds model #{b['model'] + 1}'s parameters there" if a["model"] != b["model"]
                       else f"it is a {b['kind']} there" if a["kind"] != b["kind"]
                       else f"it has {len(b['groups'])} parameter groups there, {len(a['groups'])} on rank {src}"
                       if len(a["groups"]) != len(b["groups"])
                       else "its parameter groups hold other parameters there" if a["groups"] != b["groups"] else None)
            if differs:
                raise RuntimeError(f"{label} differs on rank {rank}: {differs}{_UNCHANGED}")
            names = [spec[0] for spec in descriptions[src]["models"][a["model"]]["params"]]
            for j, entries in a["state"].items():
                have = b["state"].get(j)
                given[rank] = given.get(rank, 0) + (have is None)
                for key, spec in entries.items():
                    if have and key in have and not (spec[0] == have[key][0] == "value" or spec[:3] == have[key][:3]):
                        raise RuntimeError(f"{label}: state {key!r} of parameter {names[j]!r} is "
                                           f"{_describe_entry(have[key])} on rank {rank}, {_describe_entry(spec)} "
                                           f"on rank {src}{_UNCHANGED}")
    return {rank: n for rank, n in given.items() if n}


def _describe_entry(spec: tuple) -> str:
    return f"a {spec[2]} tensor of shape {list(spec[1])}" if spec[0] == "tensor" else f"a {spec[1]}"


def _fit_state(optimizers: list, plan: list, tensors: list) -> None:
    """Give this rank's optimizer state src's entries: a missing tensor is allocated to be broadcast
    into, where src keeps its own (by the parameter, or on the CPU as Adam's ``step``); an entry
    that src does not have is dropped."""
    for (i, groups, optimizer), spec in zip(optimizers, plan):
        for j in (j for group in groups for j in group):
            param, want = tensors[i][0][j][1], spec["state"].get(j)
            if want is None:
                optimizer.state.pop(param, None)
                continue
            have = optimizer.state.setdefault(param, {})
            for key in [key for key in have if key not in want]:
                del have[key]
            for key, (kind, *entry) in want.items():
                if kind == "tensor" and key not in have:
                    have[key] = torch.empty(entry[0], dtype=getattr(torch, entry[1]),
                                            device=param.device if entry[2] else torch.device("cpu"))


def _issue_broadcasts(jobs: list, src: int) -> list:
    """Start every broadcast without waiting: a group runs them in the order issued (the same on every
    rank), and one's setup overlaps the last one's transfer. A tensor on a device that the group's
    backend does not carry (a CPU ``step`` over NCCL alone), or not contiguous, travels as a copy."""
    carried, pending = {}, []
    for tensor, group, near in jobs:
        if id(group) not in carried:
            carried[id(group)] = _get_device_types(group)
        types = carried[id(group)]
        data, staged = tensor.data, None
        if (types is not None and data.device.type not in types) or not data.is_contiguous():
            via = near if types is None or near.type in types else torch.device("cpu")
            data = staged = data.to(via, memory_format=torch.contiguous_format, copy=True)
        pending.append((dist.broadcast(data, src=src, group=group, async_op=True), staged, tensor))
    return pending


def _get_device_types(group) -> set | None:
    """The device types ``group``'s backends take (``"cpu:gloo,cuda:nccl"``), or None where torch can't say."""
    try:
        return {part.split(":")[0] for part in dist.get_backend_config(group).split(",") if ":" in part} or None
    except Exception:
        return None


def _finish_broadcasts(pending: list) -> None:
    for work, staged, tensor in pending:
        work.wait()
        if staged is not None:
            tensor.data.copy_(staged)


def _collect_settings(optimizers: list, plan: list, tensors: list, seconds: float) -> dict:
    """What src sends as objects: each param group's hyperparameters (a tensor one, as a capturable
    ``lr``, as a CPU copy: pickled as it is, it would unpickle onto src's GPU) and the state's
    non-tensor values."""
    return {"seconds": round(seconds, 4),
            "optimizers": [{"groups": [{k: v.detach().cpu() if torch.is_tensor(v) else v
                                        for k, v in g.items() if k != "params"}
                                       for g in optimizer.param_groups],
                            "values": {j: {key: optimizer.state[tensors[i][0][j][1]][key]
                                           for key, entry in entries.items() if entry[0] == "value"}
                                       for j, entries in spec["state"].items()}}
                           for (i, _, optimizer), spec in zip(optimizers, plan)]}


def _apply_settings(optimizers: list, tensors: list, sent: list) -> None:
    for (i, _, optimizer), settings in zip(optimizers, sent):
        for group, hyper in zip(optimizer.param_groups, settings["groups"]):
            for key in [key for key in group if key != "params" and key not in hyper]:
                del group[key]
            for key, value in hyper.items():
                old = group.get(key)
                # A tensor setting is copied into the rank's own tensor, on its device (a compiled
                # step may hold that tensor); where the rank has none, it is kept on the CPU.
                if torch.is_tensor(value) and torch.is_tensor(old) and old.shape == value.shape:
                    old.copy_(value)
                else:
                    group[key] = value
        for j, values in settings["values"].items():
            optimizer.state[tensors[i][0][j][1]].update(values)


def _count_bytes(jobs: list) -> int:
    return sum(job[0].numel() * job[0].element_size() for job in jobs)
