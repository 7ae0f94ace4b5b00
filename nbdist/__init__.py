"""nbdist: interactive distributed PyTorch in Jupyter.

``%load_ext nbdist`` then ``%%distributed --nprocs 4`` on a cell, or ``nbdist.launch(fn, nprocs=4)``
from code. Every run owns its whole process tree and leaves nothing running.

The names below are imported on first use (PEP 562): ``import nbdist`` in a rank costs nothing of
the kernel side (sessions, views, psutil, atexit hooks) that the rank doesn't use.

Layout (see ``docs/contributing.md``): :mod:`nbdist.frontend` (IPython, views, CLI), :mod:`nbdist.api`,
:mod:`nbdist.options`, :mod:`nbdist.session`, :mod:`nbdist.run`, :mod:`nbdist.launchers`,
:mod:`nbdist.warmstart` on the kernel side; :mod:`nbdist.worker` on the rank side;
:mod:`nbdist.protocol`, what both read and write.
"""

from __future__ import annotations

import importlib

__all__ = [
    "launch",
    "join_job",
    "Run",
    "Session",
    "warm",
    "WarmTemplate",
    "ps",
    "kill",
    "default_nprocs",
    "rank",
    "world_size",
    "is_main",
    "WorkerFailedError",
    "RunTimeoutError",
    "RunStoppedError",
    "SessionLostError",
    "RankGoneError",
    "RankFailure",
    "LaunchConfigError",
    "load_ipython_extension",
    "unload_ipython_extension",
]

__version__ = "0.1.0"

# public name -> the module that defines it
_WHERE = {
    "launch": "nbdist.api", "ps": "nbdist.api", "kill": "nbdist.api", "default_nprocs": "nbdist.options",
    "join_job": "nbdist.frontend.job_world",
    "Run": "nbdist.run.state", "Session": "nbdist.session.handle",
    "warm": "nbdist.warmstart.handle", "WarmTemplate": "nbdist.warmstart.handle",
    "rank": "nbdist.protocol.world", "world_size": "nbdist.protocol.world", "is_main": "nbdist.protocol.world",
    "WorkerFailedError": "nbdist.errors", "RunTimeoutError": "nbdist.errors", "RunStoppedError": "nbdist.errors",
    "SessionLostError": "nbdist.errors", "RankGoneError": "nbdist.errors", "RankFailure": "nbdist.errors",
    "LaunchConfigError": "nbdist.errors",
}


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'nbdist' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython):
    """``%load_ext nbdist``: register ``%%distributed``, the session magics and the tools."""
    from nbdist.frontend.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):
    """``%unload_ext nbdist``: ``%%distributed`` cells are no longer rewritten into awaiting cells."""
    from nbdist.frontend.magics import unload_ipython_extension as _unload

    _unload(ipython)
