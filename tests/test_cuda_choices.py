"""The CUDA and NCCL choices made before CUDA is touched, checked where there is no GPU.

What torch says about the GPUs (``torch.cuda.is_available``, ``device_count``) is mocked here, the
only thing mocked: the choices themselves run for real. tests/test_gpu.py checks what follows from
them on a GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys

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


def test_auto_is_nccl_only_where_each_rank_of_the_machine_has_a_gpu_of_its_own(gpus, monkeypatch):
    # Four ranks on a one-GPU workstation: NCCL refuses a shared GPU at the first collective
    # ("Duplicate GPU detected"); gloo takes their CUDA tensors.
    gpus(1)
    assert resolve_backend("auto", local_world_size=4) == "gloo"
    assert resolve_backend("auto", local_world_size=1) == "nccl"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # as the rank's env says it
    assert resolve_backend("auto") == "gloo"
    gpus(2)
    assert resolve_backend("auto") == "nccl"
    assert resolve_backend("nccl", local_world_size=4) == "nccl"  # what the user asked for, as asked
    gpus(0)
    assert resolve_backend("auto", local_world_size=1) == "gloo"


def test_the_cuda_driver_is_seen_in_the_process_map(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert not cuda_driver.cuda_driver_loaded(str(maps))
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n")
    assert cuda_driver.cuda_driver_loaded(str(maps))
    assert not cuda_driver.cuda_driver_loaded(str(tmp_path / "absent"))
    assert not cuda_driver.cuda_driver_loaded()  # this machine: no GPU, no driver


def test_fork_is_refused_once_the_kernel_loaded_the_cuda_driver_without_a_torch_context(monkeypatch):
    # A plain torch.cuda.is_available() in a cell initialises the driver (cuInit) and torch marks
    # the process's forks as unable to use CUDA, while torch.cuda.is_initialized() stays False.
    check_start_method("fork")  # nothing loaded: allowed
    monkeypatch.setattr(cuda_driver, "cuda_driver_loaded", lambda maps_path="/proc/self/maps": True)
    with pytest.raises(LaunchConfigError, match="its driver loaded by torch.cuda.is_available"):
        check_start_method("fork")
    check_start_method("warm")  # the template is a fresh exec: the kernel's driver is not its own
    check_start_method("spawn")


@pytest.mark.parametrize("user_value", [None, "3"])
def test_an_nccl_session_raises_on_nccl_errors_instead_of_ending_the_rank(user_value):
    """torch's default (3) lets NCCL's watchdog take the process down on a timeout or a peer's aborted
    communicator; a session's ranks ask for 2 (clean up, the collective raises), unless the user
    chose. Set before any NCCL group is made: ``register`` comes before ``init_process_group``."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    if user_value is not None:
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = user_value
    code = ("import os\nfrom nbdist.worker import reformable_groups as rg\n"
            "rg.register('{backend}')\nprint(os.environ.get('TORCH_NCCL_ASYNC_ERROR_HANDLING'))")
    said = {backend: subprocess.run([sys.executable, "-c", code.format(backend=backend)], env=env, timeout=120,
                                    capture_output=True, text=True, check=True).stdout.strip()
            for backend in ("nccl", "gloo")}
    assert said == {"nccl": user_value or "2", "gloo": str(user_value)}
