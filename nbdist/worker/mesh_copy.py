"""A ``DeviceMesh`` copied to a healed rank: the same mesh, with this rank's own groups.

A mesh is bound to its rank: it holds the groups of its rank's row along each dimension (rank 0 of
a 2x2 mesh holds ``{0, 2}`` and ``{0, 1}``; rank 2 holds ``{0, 2}`` and ``{2, 3}``), its coordinate,
its rank. Survivors compare meshes without that (:func:`mesh_fingerprint`: device type, the mesh,
its dimension names); the donor sends a mesh as those and, for each dimension, the index of the
group call that made its own group (:func:`reduce_mesh`); the new rank, whose replayed calls are the
donor's (:mod:`nbdist.worker.group_replay`), builds the mesh without making groups and takes, for
each dimension, its own group made by the call of its row nearest that index (:func:`rebuild_mesh`).

Root meshes only: a slice (``mesh["tp"]``) is made again from its root on the new rank. A session's
default group binds no device (:func:`nbdist.worker.bootstrap.init_distributed`), so torch makes a
mesh's groups with ``new_group``, on GPUs too; a mesh whose groups ``split_group`` made (torchcomms)
was not recorded, and is not copied.
"""

from __future__ import annotations

import sys

from nbdist.worker import group_replay

__all__ = ["is_root_mesh", "mesh_fingerprint", "reduce_mesh", "rebuild_mesh"]


def _mesh_type():
    module = sys.modules.get("torch.distributed.device_mesh")
    return getattr(module, "DeviceMesh", None) if module is not None else None


def is_root_mesh(value) -> bool:
    """A DeviceMesh that is not a slice or a flattening of another."""
    mesh_type = _mesh_type()
    return mesh_type is not None and isinstance(value, mesh_type) and getattr(value, "_root_mesh", None) is None


def mesh_fingerprint(mesh) -> str:
    """Equal on every rank of the mesh (its rank and own groups left out)."""
    return f"device mesh {mesh.device_type} {mesh.mesh.tolist()} {mesh.mesh_dim_names}"


def reduce_mesh(mesh):
    """The pickler's reduction of a root mesh on the donor: what :func:`rebuild_mesh` needs."""
    import torch.distributed.distributed_c10d as c10d

    default = c10d._get_default_group().group_name
    calls = [None if name == default else group_replay.call_index(c10d._resolve_process_group(name))
             for name in mesh._dim_group_names]
    if any(k is None and name != default for k, name in zip(calls, mesh._dim_group_names)):
        raise TypeError("a DeviceMesh whose groups nbdist did not see made (split_group) can't be copied")
    return rebuild_mesh, (mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names, calls)


def rebuild_mesh(device_type: str, rows: list, dim_names, calls: list):
    """On the new rank: the donor's mesh, with this rank's own group along each dimension."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh

    tensor = torch.tensor(rows, dtype=torch.int)
    mesh = DeviceMesh(device_type, tensor, mesh_dim_names=dim_names, _init_backend=False)
    rank, names = dist.get_rank(), []
    for dim, near in enumerate(calls):
        if near is None:  # the whole world: the default group
            names.append(c10d._get_default_group().group_name)
            continue
        along = tensor.movedim(dim, -1).reshape(-1, tensor.shape[dim])
        row = next(r.tolist() for r in along if rank in r.tolist())
        index = group_replay.nearest_call(row, near)
        if index is None:
            raise RuntimeError(f"no group of ranks {row} was made on this rank for the mesh's dimension {dim}")
        names.append(group_replay.made_group(index).group_name)
    mesh._dim_group_names = names
    mesh._pg_registry = {name: c10d._resolve_process_group(name) for name in names}
    return mesh
