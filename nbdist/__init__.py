"""nbdist: interactive distributed PyTorch in Jupyter.

``%load_ext nbdist`` then ``%%distributed --nprocs 4`` on a cell, or ``nbdist.launch(fn, nprocs=4)``
from code. Every run owns its whole process tree and leaves nothing running.
"""

from .api import default_nprocs, kill, launch, ps
from .errors import (LaunchConfigError, RankFailure, RunStoppedError, RunTimeoutError, SessionLostError,
                     WorkerFailedError)
from .run import Run
from .session import Session
from .warmstart import WarmTemplate, warm
from .world import is_main, rank, world_size

__all__ = [
    "launch",
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
    "RankFailure",
    "LaunchConfigError",
    "load_ipython_extension",
    "unload_ipython_extension",
]

__version__ = "0.1.0"


def load_ipython_extension(ipython):
    """``%load_ext nbdist``: register ``%%distributed``, ``%dist_ps``, ``%dist_kill`` and ``%dist_logs``."""
    from .magic import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):
    from .magic import unload_ipython_extension as _unload

    _unload(ipython)
