"""A healed rank's namespace, copied from a donor: what every survivor holds alike, and nothing else.

The heal (:mod:`nbdist.session.healing`) asks every survivor for a fingerprint of each of its user
names (:func:`fingerprint_names`); a name whose fingerprint is the same on all of them is replicated
state, and is copied; one that differs is rank-specific (a shard, ``rank = dist.get_rank()``), and
one that only some hold is left out. The donor then pickles every copied name in *one* dump
(:func:`export_names`): objects shared between names stay shared (an optimizer holds the model's
parameters, not copies), and the new rank unpickles it (:func:`import_names`):

* functions and classes the cells defined travel by value (cloudpickle) and are bound to the new
  rank's ``__main__``, so a later cell that rebinds a name is seen by them as on every other rank;
  imported modules are re-imported by name;
* DDP models are bound to the new rank's default group by their own unpickling; they are tracked
  in the donor's order (:mod:`nbdist.worker.model_reset`), as the survivors' are;
* types whose value is bound to a rank get the new rank's number: ``DistributedSampler``, and the
  ``DataLoader`` (and batch sampler) holding one. That list is :data:`RANK_BOUND`, in the docs too.
"""

from __future__ import annotations

import contextvars
import hashlib
import io
import os
import pickle
import sys
import types
import zlib

from nbdist.protocol.pickling import SourceKeepingPickler
from nbdist.protocol.shared_values import IN_BAND_UNDER, load_shared, tensor_buffer
from nbdist.worker import mesh_copy, optimizer_steps
from nbdist.worker.group_replay import group_fingerprint, group_reference, made_group, resolve_group

__all__ = ["fingerprint_names", "export_names", "import_names", "import_shared_names", "user_names", "note_entry_names",
           "replicated_names", "rebuild_ddp_reducers", "RANK_BOUND"]

RANK_BOUND = ("torch.utils.data.DistributedSampler", "torch.utils.data.DataLoader (its sampler)",
              "torch.distributed.device_mesh.DeviceMesh (its own groups)")
_SKIP = {"In", "Out", "exit", "quit", "get_ipython"}
_ENTRY: dict = {}  # what the process's entry left in __main__ (spawn's spawn_main, torchrun's main)
# False while a fingerprint leaves tensors' bytes out: one survivor has nobody to compare them with,
# and reading a model's gigabytes would be most of its heal.
_TENSOR_BYTES = contextvars.ContextVar("nbdist_fingerprint_tensor_bytes", default=True)


class _Pickler(SourceKeepingPickler):
    """cloudpickle, with process groups by name (:mod:`nbdist.worker.group_replay`), and the cells'
    functions (methods of their classes too) without the globals they read: on the new rank they
    read its ``__main__`` (cloudpickle would carry a private copy of each global they use, and a
    model that can't travel, an FSDP2 one, would sink the function with it). Their code keeps its
    cell's file: a healed rank's tracebacks show the cell's lines, and a heal from that rank later
    still knows where they were defined (cloudpickle's ``<dynamic-code>`` lost both: soak, under load)."""

    def persistent_id(self, obj):
        return group_reference(obj)

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.is_cuda:
            # torch's own pickle puts it back on the donor's device index: the new rank has its own.
            return _on_own_device, (obj.detach().cpu(), isinstance(obj, torch.nn.Parameter), obj.requires_grad)
        # A big CPU tensor's bytes as one pickle-5 buffer: out of band, they reach the new rank through
        # shared memory at memcpy speed (torch's own pickle zips each storage through torch.save).
        shared = tensor_buffer(obj)
        if shared is not None:
            return shared
        if mesh_copy.is_root_mesh(obj):  # bound to its rank: the new rank takes its own groups
            return mesh_copy.reduce_mesh(obj)
        if isinstance(obj, types.FunctionType) and obj.__module__ == "__main__":
            closure = tuple(_cell_value(c) for c in obj.__closure__) if obj.__closure__ else None
            return _main_function, (obj.__code__, obj.__name__, obj.__qualname__, obj.__defaults__,
                                    obj.__kwdefaults__, closure, obj.__doc__, dict(obj.__dict__))
        return super().reducer_override(obj)


_EMPTY_CELL = "nbdist: an empty closure cell"


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet assigned
        return _EMPTY_CELL


def _on_own_device(tensor, parameter: bool, requires_grad: bool):
    """A donor's CUDA tensor on this rank's own device (the one its bootstrap bound)."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else tensor.device
    tensor = tensor.to(device)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _main_function(code, name, qualname, defaults, kwdefaults, closure, doc, attrs):
    """A cell's function on the new rank, its globals this rank's ``__main__``."""
    cells = None if closure is None else tuple(types.CellType() if isinstance(v, str) and v == _EMPTY_CELL
                                               else types.CellType(v) for v in closure)
    fn = types.FunctionType(code, sys.modules["__main__"].__dict__, name, defaults, cells)
    fn.__qualname__, fn.__kwdefaults__, fn.__doc__ = qualname, kwdefaults, doc
    fn.__dict__.update(attrs)
    return fn


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        return resolve_group(pid)


class _FingerprintPickler(_Pickler):
    """What a fingerprint hashes: tensors by their content (torch's own pickle of a tensor carries a
    random serialization id), groups as their place in the rank's calls."""

    def persistent_id(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            digest = hashlib.sha1()
            _feed(digest, obj)
            return ("tensor", digest.hexdigest())
        return group_fingerprint(obj) if group_fingerprint(obj) is not None else None


def _dumps(value, buffers: list | None = None) -> bytes:
    """``value``'s pickle; its big buffers (tensors' bytes) appended to ``buffers`` out of band, or
    left out altogether with ``buffers=None`` (a check that it pickles, which copies nothing)."""
    import numpy as np

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < IN_BAND_UNDER:
            return True  # truthy: in the pickle itself
        if buffers is not None:
            buffers.append(np.frombuffer(raw, dtype=np.uint8))  # a view: the copy is dump_shared's, once
        return False

    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=out_of_band).dump(value)
    return out.getvalue()


def user_names() -> dict:
    """The names cells made in this rank's ``__main__`` (not nbdist's, not the interpreter's)."""
    main = sys.modules["__main__"].__dict__
    return {k: v for k, v in main.items()
            if not k.startswith("_") and k not in _SKIP and not (k in _ENTRY and _ENTRY[k] is v)}


def note_entry_names() -> None:
    """Before the first cell: the names ``__main__`` holds now are the entry's (``python -c "from
    multiprocessing.spawn import spawn_main; ..."``), not the user's; :func:`user_names` leaves them
    out while they hold the same value. They stay: the entry reads them again on its way out."""
    _ENTRY.update({k: v for k, v in sys.modules["__main__"].__dict__.items() if not k.startswith("_")})


def fingerprint_names(tensor_bytes: bool = True) -> dict[str, str]:
    """``{name: fingerprint}`` of every user name: equal on two ranks when the values are equal
    (rank-bound types compared without their rank); "unpicklable: <type>" when it can't be judged.
    ``tensor_bytes=False``: tensors by their dtype and shape only (nothing to compare them with)."""
    token = _TENSOR_BYTES.set(tensor_bytes)
    try:
        return {name: _fingerprint(value) for name, value in user_names().items()}
    finally:
        _TENSOR_BYTES.reset(token)


def _fingerprint(value) -> str:
    digest = hashlib.sha1()
    try:
        if isinstance(value, types.ModuleType):
            return f"module {value.__name__}"
        group = group_fingerprint(value)
        if group is not None:
            return group
        if mesh_copy.is_root_mesh(value):
            return mesh_copy.mesh_fingerprint(value)
        if _is_sharded(value):  # FSDP2/DTensor: each rank holds its own shard, by design
            import os

            return f"sharded: rank {os.environ.get('RANK', '0')}'s shard"
        if isinstance(value, (types.FunctionType, type)) and value.__module__ == "__main__":
            _feed_definition(digest, value)  # what the cell defined, not the values it reads
        else:
            _feed(digest, value)
    except Exception as exc:  # noqa: BLE001 - whatever can't be pickled can't be copied either
        return f"unpicklable: {type(value).__name__} ({type(exc).__name__})"
    return f"{type(value).__qualname__} {digest.hexdigest()}"


def _is_sharded(value) -> bool:
    """A DTensor, or a module or optimizer over DTensors (FSDP2): rank-specific by design."""
    tensor_mod = sys.modules.get("torch.distributed.tensor")
    torch = sys.modules.get("torch")
    if tensor_mod is None or torch is None or not hasattr(tensor_mod, "DTensor"):
        return False
    dtensor = tensor_mod.DTensor
    if isinstance(value, dtensor):
        return True
    if isinstance(value, torch.nn.Module):
        return any(isinstance(p, dtensor) for p in value.parameters())
    if isinstance(value, torch.optim.Optimizer):
        return any(isinstance(p, dtensor) for g in value.param_groups for p in g["params"])
    return False


def _feed(digest, value) -> None:
    """Feed ``value``'s content into ``digest``: tensors by their bytes, rank-bound types without
    their rank, anything else by its pickle (cloudpickle, so the cells' functions too)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach()
        digest.update(f"{t.dtype} {tuple(t.shape)}".encode())
        if not _TENSOR_BYTES.get():
            return
        # CRC-32 over the bytes in place: no copy, and twice SHA-1's speed; what it tells apart is the
        # same value on two ranks from a different one, not an adversary's collision.
        raw = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        digest.update(zlib.crc32(raw).to_bytes(4, "little"))
        return
    if torch is not None and isinstance(value, torch.nn.Module):
        digest.update(type(value).__qualname__.encode())
        for key, tensor in value.state_dict().items():
            digest.update(key.encode())
            _feed(digest, tensor)
        return
    if torch is not None and isinstance(value, torch.optim.Optimizer):
        state = value.state_dict()
        for group in state["param_groups"]:
            digest.update(repr(sorted((k, repr(v)) for k, v in group.items())).encode())
        for index, per_param in sorted(state["state"].items()):
            for key, item in sorted(per_param.items()):
                digest.update(f"{index} {key}".encode())
                _feed(digest, item) if torch.is_tensor(item) else digest.update(repr(item).encode())
        return
    buf = io.BytesIO()
    _FingerprintPickler(buf, protocol=5).dump(_rank_neutral(value))
    digest.update(buf.getvalue())


def _feed_definition(digest, value) -> None:
    """A function or class of the cells by its code (names, constants, defaults), recursively."""
    if isinstance(value, types.FunctionType):
        _feed_code(digest, value.__code__)
        digest.update(repr((value.__qualname__, value.__defaults__, value.__kwdefaults__)).encode())
        return
    digest.update(f"class {value.__qualname__} {[b.__qualname__ for b in value.__bases__]}".encode())
    for key, attr in sorted(vars(value).items()):
        attr = getattr(attr, "__func__", attr)
        if isinstance(attr, types.FunctionType):
            digest.update(key.encode())
            _feed_definition(digest, attr)
        elif not key.startswith("__"):
            digest.update(f"{key}={attr!r}".encode())


def _feed_code(digest, code) -> None:
    digest.update(code.co_code + repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for const in code.co_consts:
        _feed_code(digest, const) if isinstance(const, types.CodeType) else digest.update(repr(const).encode())


def _rank_neutral(value):
    """A copy of a rank-bound value with its rank set to 0 (for comparison only)."""
    import copy

    sampler = _distributed_sampler(value)
    if sampler is None:
        return value
    saved = sampler.rank
    try:
        sampler.rank = 0
        return copy.deepcopy(value)  # pickled now, while the rank reads 0
    finally:
        sampler.rank = saved


def _distributed_sampler(value):
    """The DistributedSampler ``value`` is or holds (a DataLoader's sampler or batch sampler's), or None."""
    data = sys.modules.get("torch.utils.data")
    if data is None:
        return None
    if isinstance(value, data.DistributedSampler):
        return value
    if isinstance(value, data.DataLoader):
        for sampler in (value.sampler, getattr(value.batch_sampler, "sampler", None)):
            if isinstance(sampler, data.DistributedSampler):
                return sampler
    return None


def replicated_names(every_rank_cells=(), every_rank_values=()) -> list[str]:
    """The names whose values nbdist knows are the same on every rank: imported modules, functions and
    classes (what an import binds), DDP models (their replicas are kept equal by DDP itself), the
    optimizers over their parameters, and the functions and classes that a cell run on every rank
    defined (``every_rank_cells``: those cells' files) or that such a cell took from the notebook
    (``every_rank_values``: their names). What a heal copies when only one survivor is left to
    compare with."""
    import torch

    from nbdist.worker.model_reset import live_ddp_models

    models = {id(m) for m in live_ddp_models()}
    params = {id(p) for m in live_ddp_models() for p in m.parameters()}
    cells, sent = set(every_rank_cells), set(every_rank_values)
    out = []
    for name, value in user_names().items():
        if isinstance(value, types.ModuleType) or id(value) in models or _imported(value):  # imported by name
            out.append(name)
        elif isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) == "__main__":
            where = _defining_file(value)
            # A cell's file says where it was defined; one run on every rank defined it on every rank.
            if where in cells or (name in sent and not _is_cell_file(where)):
                out.append(name)
        elif isinstance(value, torch.optim.Optimizer) and all(
                id(p) in params for group in value.param_groups for p in group["params"]):
            out.append(name)
    return out


def _imported(value) -> bool:
    """A function or class that its module holds under its qualified name (``from torch.nn.parallel
    import DistributedDataParallel as DDP``): it is pickled as that reference, the same on every rank
    as a module is."""
    if not isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return False
    module = sys.modules.get(getattr(value, "__module__", None) or "")
    if module is None or module.__name__ == "__main__":
        return False
    found = module
    for part in getattr(value, "__qualname__", "").split("."):
        found = getattr(found, part, None)
    return found is value


def _defining_file(value) -> str:
    """The file a function's code (a class's methods') came from: a cell's file, or the notebook's."""
    if isinstance(value, type):
        for member in vars(value).values():
            member = getattr(member, "__func__", member)  # classmethod, staticmethod
            if isinstance(member, types.FunctionType) and not member.__code__.co_filename.startswith("<"):
                return member.__code__.co_filename  # not a dataclass's made methods ("<string>")
        return ""
    return value.__code__.co_filename


def _is_cell_file(path: str) -> bool:
    """A session cell's file (``<run dir>/cells/NNNN/cell.py``), not the notebook's."""
    return os.path.basename(path) == "cell.py" and os.path.basename(os.path.dirname(os.path.dirname(path))) == "cells"


def export_names(names: list[str], groups: dict | None = None) -> dict:
    """On the donor: every name of ``names`` in one dump. Returns ``{"blob": bytes, "unpicklable":
    {name: why}, "ddp_order": [name, ...], "groups": groups}``: a name that can't be pickled is left
    out, and said. ``groups``: names of group handles (``{name: k}``, the k-th group call), which the
    new rank takes from its own calls instead (torch gives a rank outside a group a stand-in)."""
    from nbdist.worker.model_reset import live_ddp_models

    main = user_names()
    values = {n: main[n] for n in names if n in main and n not in (groups or {})}
    unpicklable: dict[str, str] = {}
    buffers: list = []
    try:
        blob = _dumps(values, buffers)
    except Exception:  # noqa: BLE001 - one bad name must not sink the rest: find it, leave it out
        for name in list(values):
            try:
                _dumps(values[name])  # copies no tensor bytes: a check only
            except Exception as exc:  # noqa: BLE001
                why = str(exc).splitlines()[0][:120] if str(exc) else ""
                unpicklable[name] = f"{type(values.pop(name)).__name__}: {type(exc).__name__}: {why}"
        buffers = []
        blob = _dumps(values, buffers)
    order = {id(m): i for i, m in enumerate(live_ddp_models())}
    ddp = sorted((n for n, v in values.items() if id(v) in order), key=lambda n: order[id(values[n])])
    steps = optimizer_steps.numbering({n: v for n, v in values.items() if _is_optimizer(v)})
    return {"blob": blob, "buffers": buffers, "unpicklable": unpicklable, "ddp_order": ddp,
            "groups": dict(groups or {}), "optimizer_numbers": steps}


def _is_optimizer(value) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.optim.Optimizer)


def import_shared_names(shared) -> dict:
    """On the new rank: :func:`import_names` of what the kernel shared (the donor's export, its
    tensors' bytes mapped from the kernel's shared memory)."""
    return import_names(load_shared(shared))


def import_names(exported: dict) -> dict:
    """On the new rank: the donor's names, bound to this rank's ``__main__`` and number. Returns
    ``{"names": n}``."""
    import os

    from nbdist.worker.model_reset import track_ddp_model

    # The cells' functions read __main__; the tensors' bytes are the shared buffers, in order.
    values = _Unpickler(io.BytesIO(exported["blob"]), buffers=exported["buffers"]).load()
    for name, index in exported.get("groups", {}).items():  # this rank's own handle of that group
        values[name] = made_group(index)
    main = sys.modules["__main__"].__dict__
    rank = int(os.environ.get("RANK", "0"))
    for value in values.values():
        sampler = _distributed_sampler(value)
        if sampler is not None:
            sampler.rank = rank
    main.update(values)
    # Numbered as on the donor: a stop compares each optimizer's steps by its number on every rank.
    optimizer_steps.adopt_numbering(values, *exported["optimizer_numbers"])
    for name in exported["ddp_order"]:  # tracked as the survivors' are: their reducers reset alike
        _own_device_ids(values[name])
        track_ddp_model(values[name])
    return {"names": len(values)}


def _own_device_ids(model) -> None:
    """A DDP model copied from a donor on a GPU names the donor's device: this rank's instead (its
    parameters arrived there already). ``device`` is where Join makes its flags; ``device_ids`` and
    ``output_device`` are set only where the user gave them (DDP leaves them None otherwise)."""
    import torch

    if getattr(model, "device", None) is None or model.device.type != "cuda" or not torch.cuda.is_available():
        return
    here = torch.cuda.current_device()
    model.device = torch.device("cuda", here)
    if model.device_ids:
        model.device_ids, model.output_device = [here], here


def rebuild_ddp_reducers() -> int:
    """On every rank after the heal's copy: each DDP model's reducer built afresh, as its unpickling
    built the new rank's. A survivor's reducer keeps the bucket order its first step fixed; a fresh
    one starts from the parameters' order: two orders in one all-reduce would sum the wrong
    elements (the sizes match, so nothing would say so)."""
    from nbdist.worker.model_reset import live_ddp_models

    models = live_ddp_models()
    for model in models:
        model.__setstate__(model.__getstate__())  # DDP's own path: the default group, a new reducer
    return len(models)
