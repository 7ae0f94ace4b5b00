"""Where am I? Read a rank's place in a world from the env that torchrun, MPI or Slurm set.

Standard library only and cheap: the worker and ``launch(launcher="auto")`` both call it, and
importing mpi4py just to ask would initialise MPI in every kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["WorldInfo", "detect_world", "rank", "world_size", "is_main"]


@dataclass
class WorldInfo:
    """A world this process already belongs to, as its engine describes it."""

    kind: str  # "torchrun", "mpi" or "slurm"
    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None


def _int(env, *names):
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                continue
    return None


def detect_world(env=None) -> WorldInfo | None:
    """Return the world this process runs in, or ``None`` when it runs alone.

    torchrun comes first (it sets RANK/WORLD_SIZE/LOCAL_RANK), then MPI (Open MPI's
    ``OMPI_COMM_WORLD_*``, MPICH/Hydra's ``PMI_*``, PMIx), then Slurm's ``srun`` step.
    A world of one is no world: such a kernel spawns its own ranks.
    """
    env = os.environ if env is None else env
    size = _int(env, "WORLD_SIZE")
    rank_ = _int(env, "RANK")
    mpi_vars = any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"))
    # Under MPI, RANK/WORLD_SIZE may be ours (attach exports them): only torchrun's own marker wins then.
    torchrun = "TORCHELASTIC_RUN_ID" in env or not mpi_vars
    if torchrun and size is not None and rank_ is not None and "LOCAL_RANK" in env:
        if size > 1:
            return WorldInfo("torchrun", rank_, size, _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE"))
        return None
    size = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")
    if size is not None:
        if size <= 1:
            return None
        return WorldInfo(
            "mpi",
            _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK") or 0,
            size,
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"),
        )
    size = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if "SLURM_STEP_ID" in env and size and size > 1:
        local_size = None
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE", "")
        if tasks_per_node.split("(")[0].split(",")[0].isdigit():
            local_size = int(tasks_per_node.split("(")[0].split(",")[0])
        return WorldInfo("slurm", _int(env, "SLURM_PROCID") or 0, size, _int(env, "SLURM_LOCALID"), local_size)
    return None


def rank() -> int:
    """This process's global rank: 0 outside a distributed run.

    Examples
    --------
    >>> if nbdist.rank() == 0:
    ...     print("only once")
    """
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def world_size() -> int:
    """The number of ranks: 1 outside a distributed run."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def is_main() -> bool:
    """True on rank 0, which has the duties of logging and checkpoints."""
    return rank() == 0
