"""Whether this process has loaded the CUDA driver: a fork of it can't use CUDA then.

torch's ``cuda.is_initialized()`` says only whether torch made its context. A plain
``torch.cuda.is_available()`` (without ``PYTORCH_NVML_BASED_CUDA_CHECK=1``) asks the runtime for
the device count, which initialises the driver (``cuInit``) and marks the process as one whose
forks can't use CUDA; so may another library (CuPy, Numba). The driver is ``libcuda.so``, mapped
into the process once loaded: this reads the process's own map, and loads nothing.
"""

from __future__ import annotations

__all__ = ["cuda_driver_loaded"]


def cuda_driver_loaded(maps_path: str = "/proc/self/maps") -> bool:
    """True when ``libcuda.so`` is mapped into this process (False where there is no such map)."""
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as fh:
            return any("/libcuda.so" in line for line in fh)
    except OSError:
        return False
