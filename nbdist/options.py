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
from dataclasses import dataclass, field, fields

from nbdist.errors import LaunchConfigError

__all__ = ["WorldOptions", "BACKENDS", "MAX_NPROCS_ENV", "default_nprocs", "max_local_nprocs"]

BACKENDS = ("auto", "gloo", "nccl", "mpi", "ucc", "xccl")
MAX_NPROCS_ENV = "NBDIST_MAX_NPROCS"  # how a user insists on more local ranks than the check allows
# Engines that place ranks themselves (a hostfile, an allocation): the count is theirs to judge.
_PLACED_ELSEWHERE = ("mpirun", "srun")


def default_nprocs() -> int:
    """The number of GPUs, or 2 on a machine without one. Never initialises CUDA (fork stays safe).

    A kernel that hasn't imported torch asks its store host, which counted them: the kernel stays
    without torch (:mod:`nbdist.launchers.store_host`).
    """
    from nbdist.launchers.store_host import cuda_device_count

    counted = cuda_device_count()
    if counted is not None:
        return counted if counted > 0 else 2
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


def _option(default, help: str = "", flags=None, session: bool = True, shape: bool = False, **argparse_kw):
    """A world option: its default, and how ``%%distributed``/``%dist_start`` spell it (``flags`` None: not a
    flag of the magics). ``session``: also a :class:`nbdist.Session` argument. ``shape``: it defines the
    world, so a session cell may not ask for another value than the session's."""
    meta = {"help": help, "flags": flags, "session": session, "shape": shape, "argparse": argparse_kw}
    return field(default=default, metadata=meta)


@dataclass
class WorldOptions:
    """The ranks of a run: how many, started how, meeting where. Defined here once: ``launch``,
    ``Session``, ``%%distributed`` and ``%dist_start`` all read these fields (and the magics' flags,
    defaults and help come from their metadata).

    The fields are :func:`nbdist.launch`'s keyword arguments of the same names (see there).

    Examples
    --------
    >>> opts = WorldOptions(nprocs=4, backend="gloo").check()
    >>> opts.nprocs
    4
    """

    nprocs: int | None = _option(None, "number of ranks (default: the number of GPUs, or 2 without one)",
                                 ("-n", "--nprocs"), shape=True, type=int)
    launcher: str = _option("auto", "auto, spawn, attach, torchrun, mpirun or srun", ("--launcher",), shape=True)
    backend: str = _option("auto", "auto (nccl with CUDA, gloo without or where ranks would share a GPU), gloo or nccl", ("--backend",), shape=True)
    dist_url: str = _option("auto", session=False)
    init_process_group: bool = _option(True, "don't initialise the process group", ("--no-init",), session=False,
                                       action="store_false", dest="init_process_group")
    timeout: float | None = _option(None, "seconds; then dump every rank's stack and stop", session=False)
    env: dict | None = _option(None, "environment for the ranks", ("--env",), nargs="+", action="append",
                               metavar="K=V")
    start_method: str | None = _option(None, "how the ranks are made (default: warm once the template is ready, "
                                       "else spawn)", ("--start",), choices=("warm", "spawn", "fork"),
                                       dest="start_method")
    run_dir: str | None = _option(None, "folder for the run dir (default $NBDIST_RUN_DIR or a private temp dir)",
                                  ("--run-dir",))
    stop_timeout: float = _option(5.0, session=False)
    launcher_args: list | None = _option(None, "extra engine arguments, quoted: --launcher-args '--hostfile h'",
                                         ("--launcher-args",))
    nnodes: int = _option(1, "torchrun: nodes (kernels) in the world; srun: -N", ("--nnodes",), shape=True, type=int)
    node_rank: int = _option(0, "torchrun: this kernel's node", ("--node-rank",), shape=True, type=int)
    master_addr: str | None = _option(None, "where ranks reach the kernel (default 127.0.0.1, or this machine's "
                                      "address when ranks may run elsewhere); torchrun: node 0's address",
                                      ("--master-addr",))
    master_port: int | None = _option(None, "torchrun with --nnodes > 1: the rendezvous port", ("--master-port",),
                                      type=int)
    # How errors name an option: "api" (``nprocs=0``) or "magic" (``--nprocs 0``).
    spelling: str = field(default="api", repr=False, compare=False)

    @classmethod
    def names(cls, session_only: bool = False) -> tuple[str, ...]:
        """The options' names (those a Session takes, with ``session_only``)."""
        return tuple(f.name for f in fields(cls) if "help" in f.metadata and (f.metadata["session"] or not session_only))

    @classmethod
    def from_call(cls, arguments: dict) -> WorldOptions:
        """From a call's ``locals()`` (``launch``, ``Session``): the options among them, unchecked."""
        return cls(**{name: arguments[name] for name in cls.names() if name in arguments})

    @classmethod
    def magic_flags(cls, exclude=()) -> list[tuple[tuple, dict]]:
        """``(flags, argparse keywords)`` of each option the magics take, for IPython's ``argument``."""
        out = []
        for f in fields(cls):
            meta = f.metadata
            if not meta.get("flags") or f.name in exclude:
                continue
            kw = dict(meta["argparse"], help=meta["help"])
            if kw.get("action") != "store_false":
                kw.setdefault("default", [] if kw.get("action") == "append" else
                              "" if f.name == "launcher_args" else f.default)
            out.append((meta["flags"], kw))
        return out

    @classmethod
    def shape_defaults(cls) -> dict:
        """The options that define a world, with their defaults (a session cell's flags must match its session)."""
        return {f.name: f.default for f in fields(cls) if f.metadata.get("shape")}

    @classmethod
    def from_magic_args(cls, args) -> WorldOptions:
        """From ``%%distributed``/``%dist_start`` flags (parsed by IPython's magic_arguments), unchecked.

        ``--env K=V`` pairs are parsed by the front end (:func:`nbdist.frontend.cell_job.world_options`).
        """
        given = {name: getattr(args, name) for name in cls.names() if hasattr(args, name)}
        given["launcher_args"] = shlex.split(given.get("launcher_args") or "") or None
        given["env"] = None
        return cls(**given, spelling="magic")

    def _name(self, option: str) -> str:
        if self.spelling == "magic":
            flags = next(f.metadata.get("flags") for f in fields(self) if f.name == option)
            return flags[-1] if flags else "--" + option.replace("_", "-")
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
        return {name: getattr(self, name) for name in self.names(session_only=True)}
