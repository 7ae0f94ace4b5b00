"""The CUDA and NCCL choices made before CUDA is touched, checked where there is no GPU.

What torch says about the GPUs (``torch.cuda.is_available``, ``device_count``) is mocked here, the
only thing mocked: the choices themselves run for real. tests/test_gpu.py checks what follows from
them on a GPU machine.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from nbdist.errors import LaunchConfigError
from nbdist.launchers.spawn import check_start_method
from nbdist.worker import cuda_driver
from nbdist.worker.bootstrap import resolve_backend


@pytest.fixture
def gpus(monkeypatch):
    """This machine has ``n`` GPUs, as torch would say (NCCL built in)."""
    def have(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    return have


def test_auto_is_gloo_where_more_ranks_than_gpus_share_the_machine(gpus):
    # Four ranks on a one-GPU workstation: NCCL refuses a shared GPU at the first collective
    # ("Duplicate GPU detected"); gloo takes their CUDA tensors.
    gpus(1)
    assert resolve_backend("auto", ranks_sharing_gpus=4) == "gloo"
    assert resolve_backend("auto", ranks_sharing_gpus=1) == "nccl"
    assert resolve_backend("auto") == "nccl"  # an engine's ranks: each may see a GPU of its own
    assert resolve_backend("nccl", ranks_sharing_gpus=4) == "nccl"  # what the user asked for, as asked
    gpus(2)
    assert resolve_backend("auto", ranks_sharing_gpus=2) == "nccl"
    gpus(0)
    assert resolve_backend("auto") == "gloo"


@pytest.mark.parametrize("start, world, local, sharing", [
    ("warm", 4, 4, 4), ("spawn", 4, 4, 4), ("fork", 2, 2, 2),
    ("spawn", 8, 4, 1),  # a node of a world across kernels: every node chooses alike
    ("srun", 4, 4, 1), ("mpirun", 4, 4, 1), ("torchrun", 4, 4, 1),  # the engine may bind GPUs itself
])
def test_the_ranks_said_to_share_the_gpus_are_nbdists_own_on_one_machine(monkeypatch, start, world, local, sharing):
    from nbdist.protocol.rundir import RankIdentity, RunSpec
    from nbdist.worker import bootstrap

    asked = []
    monkeypatch.setattr(bootstrap, "resolve_backend", lambda backend, n=1: asked.append(n) or "gloo")
    monkeypatch.setattr(bootstrap, "bind_device", lambda *a: "cpu")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # stop before joining a group
    spec = RunSpec(run_id="r", nprocs=local, world_size=world, init_method="env://", start_method=start)
    bootstrap.init_distributed(spec, RankIdentity(rank=0, local_rank=0, world_size=world, local_world_size=local))
    assert asked == [sharing]


def test_the_cuda_driver_is_seen_initialised_in_proc(tmp_path):
    """Both signs: the driver mapped (a library that merely links it maps it too), and
    /dev/nvidia-uvm open (cuInit opens it; NVML's checks don't)."""
    maps, fds = tmp_path / "maps", tmp_path / "fd"
    fds.mkdir()
    os.symlink("/dev/null", fds / "0")
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert not cuda_driver.cuda_driver_initialised(str(maps), str(fds))
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n")
    assert not cuda_driver.cuda_driver_initialised(str(maps), str(fds))  # linked, not initialised
    os.symlink("/dev/nvidia-uvm", fds / "7")
    assert cuda_driver.cuda_driver_initialised(str(maps), str(fds))
    assert not cuda_driver.cuda_driver_initialised(str(tmp_path / "absent"), str(fds))


def test_fork_is_refused_once_the_kernel_loaded_the_cuda_driver_without_a_torch_context(monkeypatch):
    # A plain torch.cuda.is_available() in a cell initialises the driver (cuInit) and torch marks
    # the process's forks as unable to use CUDA, while torch.cuda.is_initialized() stays False.
    monkeypatch.setattr(cuda_driver, "cuda_driver_initialised", lambda *a: False)
    check_start_method("fork")  # nothing initialised: allowed
    monkeypatch.setattr(cuda_driver, "cuda_driver_initialised", lambda *a: True)
    with pytest.raises(LaunchConfigError, match="its driver initialised by torch.cuda.is_available"):
        check_start_method("fork")
    check_start_method("warm")  # the template is a fresh exec: the kernel's driver is not its own
    check_start_method("spawn")
