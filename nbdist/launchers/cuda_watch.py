"""Who initialised CUDA in this kernel: the one thing a forked rank can't survive, named in its refusal.

torch initialises CUDA lazily, through ``torch.cuda._lazy_init`` (the C++ side calls it by name, so a
wrapper sees every first use: ``.cuda()``, a tensor made on a GPU, ``torch.cuda.current_device()``).
Once torch is imported in the kernel, nbdist wraps it to remember the first caller outside torch:
the notebook cell and line, or the script's. A CUDA context that existed before the watch began is
said to be older than it.
"""

from __future__ import annotations

import os
import sys
import traceback

__all__ = ["watch_cuda_init", "who_initialised_cuda"]

_FIRST: dict[str, str | None] = {"where": None}


def watch_cuda_init() -> bool:
    """Start watching, if torch is imported and CUDA not initialised yet; True when watching (or done)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is None or not hasattr(cuda, "_lazy_init"):
        return False
    if getattr(cuda._lazy_init, "_nbdist_watch", False) or cuda.is_initialized():
        return True
    real = cuda._lazy_init

    def _lazy_init():
        if _FIRST["where"] is None and not cuda.is_initialized():
            _FIRST["where"] = _first_caller()
        return real()

    _lazy_init._nbdist_watch = True
    cuda._lazy_init = _lazy_init
    return True


def _first_caller() -> str:
    """The innermost frame outside torch and nbdist: ``"In[5], line 3: model.cuda()"``."""
    skip = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            os.path.dirname(sys.modules["torch"].__file__))
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not os.path.abspath(frame.filename).startswith(skip):
            code = f": {frame.line.strip()}" if frame.line else ""
            return f"{frame.filename}, line {frame.lineno}{code}"
    return "torch itself"


def who_initialised_cuda() -> str | None:
    """Where CUDA was first initialised in this kernel, if nbdist saw it happen."""
    return _FIRST["where"]
