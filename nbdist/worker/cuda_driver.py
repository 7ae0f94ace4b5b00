"""Whether this process initialised the CUDA driver: a fork of it can't use CUDA then.

torch's ``cuda.is_initialized()`` says only whether torch made its context. A plain
``torch.cuda.is_available()`` (without ``PYTORCH_NVML_BASED_CUDA_CHECK=1``) asks the runtime for
the device count, which initialises the driver (``cuInit``), and torch marks the process as one
whose forks can't use CUDA; another library (CuPy, Numba) may initialise it too. This reads two
signs from ``/proc``, loading nothing: the driver (``libcuda.so``) is mapped, and ``/dev/nvidia-uvm``
is open, which ``cuInit`` opens and NVML's checks, or a library that merely links the driver, don't.
"""

from __future__ import annotations

import os

__all__ = ["cuda_driver_initialised"]


def cuda_driver_initialised(maps_path: str = "/proc/self/maps", fd_dir: str = "/proc/self/fd") -> bool:
    """True when ``libcuda.so`` is mapped into this process and ``/dev/nvidia-uvm`` is open in it."""
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as fh:
            if not any("/libcuda.so" in line for line in fh):
                return False
        names = os.listdir(fd_dir)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(os.path.join(fd_dir, name)) == "/dev/nvidia-uvm":
                return True
        except OSError:  # closed meanwhile
            continue
    return False
