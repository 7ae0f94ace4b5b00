"""The run dir: the one record of a run, written by the kernel and read by the ranks.

Layout (all files 0600 in a 0700 folder, because the payload is code)::

    spec.json            RunSpec: run id, world layout, backend, rendezvous, kernel pid
    payload.pkl          the cloudpickled function, its arguments and notebook source lines (a
                         session cell's small payload comes with its message instead)
    cell.py              the cell source (written by the magic), so tracebacks show real lines
    rank{R}.stdout/.stderr   everything the rank wrote to fd 1 and 2
    result.{R}.pkl       the rank's return value
    error.{R}.json       the rank's exception, formatted
    ranks/{R}.pid        "pid host" of rank R, and ranks/{R}.running once it is in the user's code
                         (:mod:`nbdist.protocol.registration`: one file per rank, no shared appends)
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

__all__ = [
    "RunSpec",
    "RankIdentity",
    "choose_runs_root",
    "create_run_dir",
    "discard_run_dir",
    "new_run_id",
    "TEMPLATE_PREFIX",
    "STORE_HOST_PREFIX",
    "write_private",
    "write_spec",
    "read_spec",
    "pack_payload",
    "write_payload",
    "read_payload",
    "write_result",
    "read_result",
    "has_result",
    "has_error",
    "write_error",
    "read_error",
    "log_path",
    "PULL_FILE",
    "PUSH_FILE",
    "PAYLOAD_FILE",
    "RUN_ID_ENV",
    "RUN_DIR_ENV",
]

RUN_ID_ENV = "NBDIST_RUN_ID"
RUN_DIR_ENV = "NBDIST_RUN_DIR"
PULL_FILE = "pull.pkl"  # the --pull variables rank 0 leaves for the kernel
PUSH_FILE = "pushed.pkl"  # the notebook values a cell reads
PAYLOAD_FILE = "payload.pkl"
_HOST = socket.gethostname()


@dataclass
class RankIdentity:
    """Where a rank sits in the world; set in the env exactly as torchrun names it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int = 0  # torchrun's GROUP_RANK


@dataclass
class RunSpec:
    """Everything a rank needs to know besides the payload. Crosses the kernel/rank boundary as JSON."""

    run_id: str
    nprocs: int
    world_size: int
    node_rank: int = 0
    backend: str = "auto"
    init_method: str | None = None  # "env://" or "tcp://host:port"; None means don't init
    master_addr: str | None = "127.0.0.1"  # None: the engine sets MASTER_ADDR/PORT (torchrun)
    master_port: int | None = None
    use_agent_store: bool = True  # the kernel hosts the TCPStore; every rank is a client
    parent_pid: int = 0
    pdeathsig: bool = True
    start_method: str = "spawn"
    mp_start_method: str | None = None  # the kernel's own multiprocessing default, for the rank's children
    kernel_host: str | None = None  # ranks on another host mirror their output over the channel
    output_channel: list | None = None  # [host, port] of the kernel's OutputChannel, or None
    output_key: str | None = None  # the channel's HMAC key (this file is 0600 in a 0700 folder)
    reformable: bool = False  # a session's ranks: groups it can re-form in place (nbdist.worker.reformable_groups)
    created: float = field(default_factory=time.time)

    def identity_for(self, local_rank: int, node_rank: int | None = None) -> RankIdentity:
        """Rank ``local_rank`` of node ``node_rank`` (this spec's node by default)."""
        node = self.node_rank if node_rank is None else node_rank
        return RankIdentity(
            rank=node * self.nprocs + local_rank,
            local_rank=local_rank,
            world_size=self.world_size,
            local_world_size=self.nprocs,
            node_rank=node,
        )


# A warm template's run id (nbdist.warmstart.handle) starts with this; ps tells templates from ranks by it.
TEMPLATE_PREFIX = "warm-"
# A kernel's store host (nbdist.launchers.store_host): a helper of the kernel like its template, not a rank.
STORE_HOST_PREFIX = "store-"


def new_run_id() -> str:
    """Readable and unique: time of day plus 6 random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def choose_runs_root(base: str | None = None) -> str:
    """The folder under which run dirs live: ``base``, ``$NBDIST_RUN_DIR`` or a private temp folder.

    A run dir holds code that every rank executes (its payload), so the folder above it must be
    yours alone: not a symlink (someone could point it elsewhere), owned by you, and writable by
    nobody else (a group-writable folder lets a member rename your run dir and plant a payload).
    Otherwise :class:`UntrustedRunsRoot` says why, in one line, before anything is written.
    """
    import stat

    from nbdist.errors import UntrustedRunsRoot

    given = base or os.environ.get(RUN_DIR_ENV)
    root = given or os.path.join(tempfile.gettempdir(), f"nbdist-{os.getuid()}")
    setting = "run_dir=/--run-dir" if base else (RUN_DIR_ENV if given else None)
    fix = f"; choose a folder of your own ({setting})" if setting else f"; remove it, or set {RUN_DIR_ENV}"
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedRunsRoot(f"the runs folder {root} is a symlink, which another user could point elsewhere; "
                                f"nbdist writes code there that your ranks run{fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedRunsRoot(f"the runs folder {root} is not a folder{fix}")
    # A shared /tmp folder that someone else made first must not become our code drop.
    if st.st_uid != os.getuid():
        raise UntrustedRunsRoot(f"the runs folder {root} belongs to uid {st.st_uid}, not to you{fix}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "its group" if not st.st_mode & stat.S_IWOTH else "everyone"
        raise UntrustedRunsRoot(f"the runs folder {root} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}), "
                                f"who could replace a run's payload with their own code; make it yours alone "
                                f"(chmod go-w {root}){fix}")
    return root


def create_run_dir(run_id: str, base: str | None = None) -> str:
    """Make the private run dir (0700) for ``run_id`` and return its path."""
    path = os.path.join(choose_runs_root(base), run_id)
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask; be exact
    return path


def discard_run_dir(run_dir: str) -> None:
    """Remove the dir of a run that never started (a refused launch leaves nothing behind)."""
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)


def write_private(path: str, data: bytes) -> None:
    """Write atomically with mode 0600, so a reader sees nothing or everything."""
    # Unique across the hosts that share a run dir (a pid alone is not), and across threads.
    tmp = f"{path}.{_HOST}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    except BaseException:
        os.unlink(tmp)
        raise
    os.replace(tmp, path)


def write_spec(run_dir: str, spec: RunSpec) -> None:
    write_private(os.path.join(run_dir, "spec.json"), json.dumps(asdict(spec), indent=1).encode())


def read_spec(run_dir: str) -> RunSpec:
    with open(os.path.join(run_dir, "spec.json"), "rb") as fh:
        return RunSpec(**json.load(fh))


_ON_DISK: set[str] = set()  # linecache's files found on disk: the ranks read those themselves


def _collect_notebook_sources(skip=frozenset(), limit_bytes: int = 4_000_000) -> dict[str, list[str]]:
    """Source lines of code that lives only in this process's linecache (notebook cells), but for
    the files in ``skip`` (a session's ranks already hold them).

    Ranks load functions by value; without these lines their tracebacks would show line numbers
    with no source. Files that exist on disk are read there, so only virtual files travel.
    """
    import linecache

    out, size = {}, 0
    for filename, entry in list(linecache.cache.items()):
        if len(entry) < 3 or filename in skip or filename in _ON_DISK:
            continue
        if os.path.exists(filename):
            _ON_DISK.add(filename)
            continue
        lines = entry[2]
        n = sum(len(line) for line in lines)
        if size + n > limit_bytes:
            break
        out[filename], size = list(lines), size + n
    return out


def pack_payload(fn, args=(), kwargs=None, extra=None, sources_held=frozenset()) -> tuple[bytes, set[str]]:
    """cloudpickle ``fn`` with its arguments (errors name the bad argument); ``(bytes, files sent)``.

    The notebook's cell sources go along, but for ``sources_held`` (the files a session's ranks
    got with an earlier cell: a notebook of many cells would send them all again each time)."""
    import pickle

    from nbdist.protocol.pickling import dump_pickle_checked

    kwargs = dict(kwargs or {})
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    parts = {"fn": dump_pickle_checked(fn, f"the function {getattr(fn, '__qualname__', fn)!r}")}
    parts["args"] = [dump_pickle_checked(a, f"positional argument {i}") for i, a in enumerate(args)]
    parts["kwargs"] = {k: dump_pickle_checked(v, f"argument {k!r}") for k, v in kwargs.items()}
    parts["extra"] = {k: dump_pickle_checked(v, f"{k!r}") for k, v in (extra or {}).items()}
    parts["sources"] = _collect_notebook_sources(sources_held)
    return pickle.dumps(parts), set(parts["sources"])


def write_payload(run_dir: str, fn, args=(), kwargs=None, extra=None, sources_held=frozenset()) -> set[str]:
    """:func:`pack_payload` into ``payload.pkl``; returns the notebook source files it sent."""
    data, sent = pack_payload(fn, args, kwargs, extra, sources_held)
    write_private(os.path.join(run_dir, PAYLOAD_FILE), data)
    return sent


def read_payload(run_dir: str, data: bytes | None = None):
    """Return ``(fn, args, kwargs, extra)`` from ``data`` (a session cell's payload came with its
    message) or ``payload.pkl``, and seed linecache with the notebook's sources."""
    import linecache
    import pickle

    if data is None:
        with open(os.path.join(run_dir, PAYLOAD_FILE), "rb") as fh:
            data = fh.read()
    parts = pickle.loads(data)
    for filename, lines in parts.get("sources", {}).items():
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    fn = pickle.loads(parts["fn"])
    args = [pickle.loads(a) for a in parts["args"]]
    kwargs = {k: pickle.loads(v) for k, v in parts["kwargs"].items()}
    extra = {k: pickle.loads(v) for k, v in parts.get("extra", {}).items()}
    return fn, args, kwargs, extra


def log_path(run_dir: str, rank: int, stream: str) -> str:
    return os.path.join(run_dir, f"rank{rank}.{stream}")


def write_result(run_dir: str, rank: int, value) -> None:
    """Leave the rank's value for the kernel, big tensors and arrays as buffers it maps."""
    from nbdist.protocol.shared_values import write_value_file

    write_value_file(os.path.join(run_dir, f"result.{rank}.pkl"), value, f"the return value of rank {rank}")


def read_result(run_dir: str, rank: int):
    """Return ``(True, value)`` or ``(False, None)`` when the rank wrote no result."""
    from nbdist.protocol.shared_values import read_value_file

    try:
        return True, read_value_file(os.path.join(run_dir, f"result.{rank}.pkl"))
    except FileNotFoundError:
        return False, None


def has_result(run_dir: str, rank: int) -> bool:
    """Whether the rank left a value (without loading it)."""
    return os.path.exists(os.path.join(run_dir, f"result.{rank}.pkl"))


def has_error(run_dir: str, rank: int) -> bool:
    """Whether the rank left an error record."""
    return os.path.exists(os.path.join(run_dir, f"error.{rank}.json"))


def write_error(run_dir: str, rank: int, info: dict) -> None:
    write_private(os.path.join(run_dir, f"error.{rank}.json"), json.dumps(info).encode())


def read_error(run_dir: str, rank: int) -> dict | None:
    try:
        with open(os.path.join(run_dir, f"error.{rank}.json"), "rb") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None
