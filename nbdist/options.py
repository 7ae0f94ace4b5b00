"""World options: where and how a run's ranks live, built once and checked in one place.

``nbdist.launch``, ``%%distributed`` (and the session front ends that come next) all describe
their ranks with one :class:`WorldOptions`: from keyword arguments (:meth:`WorldOptions.check`)
or from magic flags (:meth:`WorldOptions.from_magic_args`). Bad input is one line that names the
option as the user wrote it (``nprocs=`` or ``--nprocs``), raised before any file or process
exists. No IPython here.
"""

from __future__ import annotations

import numbers
import os
import shlex
from dataclasses import dataclass, field

from nbdist.errors import LaunchConfigError

__all__ = ["WorldOptions", "BACKENDS", "MAX_NPROCS_ENV", "default_nprocs", "max_local_nprocs"]

BACKENDS = ("auto", "gloo", "nccl", "mpi", "ucc", "xccl")
MAX_NPROCS_ENV = "NBDIST_MAX_NPROCS"  # how a user insists on more local ranks than the check allows
# Engines that place ranks themselves (a hostfile, an allocation): the count is theirs to judge.
_PLACED_ELSEWHERE = ("mpirun", "srun")
# Magic flags whose names are not "--" + the field name.
_FLAGS = {"start_method": "--start", "init_process_group": "--no-init"}


def default_nprocs() -> int:
    """The number of GPUs, or 2 on a machine without one. Never initialises CUDA (fork stays safe)."""
    try:
        import torch

        n = torch.cuda.device_count()  # NVML-based where possible: no CUDA context is created
    except Exception:
        n = 0
    return n if n > 0 else 2


def max_local_nprocs() -> int:
    """How many ranks one machine runs before a count is taken for a typo: 8 per core, at least 64.

    ``$NBDIST_MAX_NPROCS`` overrides it.
    """
    given = os.environ.get(MAX_NPROCS_ENV, "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(64, 8 * (os.cpu_count() or 1))


def _is_int(value, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= low


@dataclass
class WorldOptions:
    """The ranks of a run: how many, started how, meeting where.

    The fields are :func:`nbdist.launch`'s keyword arguments of the same names (see there).

    Examples
    --------
    >>> opts = WorldOptions(nprocs=4, backend="gloo").check()
    >>> opts.nprocs
    4
    """

    nprocs: int | None = None
    launcher: str = "auto"
    backend: str = "auto"
    dist_url: str = "auto"
    init_process_group: bool = True
    timeout: float | None = None
    env: dict | None = None
    start_method: str | None = None
    run_dir: str | None = None
    stop_timeout: float = 5.0
    launcher_args: list | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    # How errors name an option: "api" (``nprocs=0``) or "magic" (``--nprocs 0``).
    spelling: str = field(default="api", repr=False, compare=False)

    @classmethod
    def from_magic_args(cls, args) -> WorldOptions:
        """From ``%%distributed`` flags (parsed by IPython's magic_arguments), unchecked."""
        return cls(nprocs=args.nprocs, launcher=args.launcher, backend=args.backend,
                   init_process_group=not getattr(args, "no_init", False), timeout=getattr(args, "timeout", None),
                   env=None, start_method=args.start, run_dir=args.run_dir,
                   launcher_args=shlex.split(args.launcher_args or "") or None, nnodes=args.nnodes,
                   node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                   spelling="magic")

    def _name(self, option: str) -> str:
        if self.spelling == "magic":
            return _FLAGS.get(option, "--" + option.replace("_", "-"))
        return option

    def check(self) -> WorldOptions:
        """Raise LaunchConfigError (one line) for what can't work; return self. Starts nothing."""
        from nbdist.launchers import ENGINES, check_launcher_name
        from nbdist.launchers.rendezvous import check_dist_url
        from nbdist.launchers.spawn import START_METHODS

        n = self._name
        if self.nprocs is not None and not _is_int(self.nprocs, 1):
            raise LaunchConfigError(f"{n('nprocs')} must be an int >= 1, got {self.nprocs!r}")
        check_launcher_name(self.launcher)
        check_dist_url(self.dist_url)
        if self.backend not in BACKENDS:
            raise LaunchConfigError(f"{n('backend')} must be one of {', '.join(BACKENDS)}; unknown backend {self.backend!r}")
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(self.timeout, numbers.Real)
                                         or self.timeout <= 0):
            raise LaunchConfigError(f"{n('timeout')} must be a positive number of seconds, got {self.timeout!r}")
        if self.env is not None and (not isinstance(self.env, dict)
                                     or not all(isinstance(k, str) and k and "=" not in k for k in self.env)):
            raise LaunchConfigError(f"{n('env')} must be a dict of variable names to values, e.g. {{'NCCL_DEBUG': 'INFO'}}")
        if self.start_method is not None and self.start_method not in START_METHODS:
            raise LaunchConfigError(f"{n('start_method')} must be one of {START_METHODS}, got {self.start_method!r}")
        for name, low in (("nnodes", 1), ("node_rank", 0)):
            if not _is_int(getattr(self, name), low):
                raise LaunchConfigError(f"{n(name)} must be an int >= {low}, got {getattr(self, name)!r}")
        if self.launcher_args is not None and self.launcher not in ENGINES:
            raise LaunchConfigError(f"{n('launcher_args')} are for an engine ({', '.join(ENGINES)}), "
                                    f"not {n('launcher')}={self.launcher!r}")
        if (self.nnodes != 1 or self.node_rank != 0 or self.master_port is not None) and self.launcher not in ENGINES:
            raise LaunchConfigError(f"{n('nnodes')}, {n('node_rank')} and {n('master_port')} are for "
                                    f"{n('launcher')} torchrun or srun, not {self.launcher!r}")
        if self.launcher == "torchrun" and self.dist_url != "auto":
            raise LaunchConfigError("launcher='torchrun' brings its own rendezvous (env://); leave dist_url='auto'")
        self._check_placeable()
        return self

    def _check_placeable(self) -> None:
        """A rank count this machine can't sensibly run is a typo until the user says otherwise."""
        if self.nprocs is None or self.launcher in _PLACED_ELSEWHERE:
            return
        limit = max_local_nprocs()
        if self.nprocs > limit:
            raise LaunchConfigError(
                f"{self._name('nprocs')}={self.nprocs} is more ranks than this machine can sensibly run "
                f"({os.cpu_count()} CPU cores: at most {limit} ranks per machine); to insist, set "
                f"{MAX_NPROCS_ENV}={self.nprocs}")

    def resolved_nprocs(self) -> int:
        """``nprocs``, or the default (the GPUs, or 2)."""
        return self.nprocs or default_nprocs()

    def make_engine(self):
        """The engine launcher (torchrun, mpirun, srun) these options name, or None for spawn/attach."""
        from nbdist.launchers import make_engine_launcher

        return make_engine_launcher(self.launcher, self.launcher_args, nnodes=self.nnodes, node_rank=self.node_rank,
                                    master_addr=self.master_addr, master_port=self.master_port)

    def session_kwargs(self) -> dict:
        """The keyword arguments of :class:`nbdist.Session` these options stand for."""
        names = ("nprocs", "launcher", "backend", "env", "run_dir", "launcher_args", "nnodes", "node_rank",
                 "master_addr", "master_port", "start_method")
        return {name: getattr(self, name) for name in names}
