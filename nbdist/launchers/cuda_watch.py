"""Who initialised CUDA in this kernel: the one thing a forked rank can't survive, named in its refusal.

torch initialises CUDA lazily, through ``torch.cuda._lazy_init`` (the C++ side calls it by name, so a
wrapper sees every first use: ``.cuda()``, a tensor made on a GPU, ``torch.cuda.current_device()``).
Once torch is imported in the kernel, nbdist wraps it to remember the first caller outside torch:
the notebook cell and line, or the script's. A CUDA context that existed before the watch began is
said to be older than it.

nbdist itself doesn't import torch in the kernel (the store host holds the runs' stores), so the
watch waits for the user's own ``import torch`` (:func:`watch_cuda_init_when_imported`): a cell that
imports torch and calls ``.cuda()`` is then named, before any launch could have started the watch.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback

__all__ = ["watch_cuda_init", "watch_cuda_init_when_imported", "who_initialised_cuda"]

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


class _WatchOnImport:
    """A ``sys.meta_path`` finder that answers for nobody: it only sees ``torch`` being found, and
    has its loader start the watch once torch's ``__init__`` ran (``torch.cuda`` is there by then)."""

    _guard = threading.local()  # our own lookup of torch's spec must not find us again

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or getattr(self._guard, "busy", False):
            return None
        import importlib.util

        self._guard.busy = True
        try:
            spec = importlib.util.find_spec("torch")
        finally:
            self._guard.busy = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None  # let the import system find it the usual way; a later launch watches then
        real = loader.exec_module

        def exec_module(module):
            try:
                real(module)
            finally:
                # An attribute of this loader instance only: torch's own, made for this import.
                loader.__dict__.pop("exec_module", None)
                _remove_hook()
            watch_cuda_init()

        loader.exec_module = exec_module
        return spec


_HOOK = _WatchOnImport()


def _remove_hook() -> None:
    try:
        sys.meta_path.remove(_HOOK)
    except ValueError:
        pass


def watch_cuda_init_when_imported() -> None:
    """Watch now if torch is imported; otherwise as soon as anything imports it (a hook on ``import``)."""
    if "torch" in sys.modules:
        watch_cuda_init()
    elif _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


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
