"""Two hooks into ``multiprocessing``'s spawn, active only in the thread that starts our ranks.

* **No ``__main__`` re-run**: everything a rank runs travels by value in the run dir, so the parent's
  main module is not needed there. Re-running it is what makes ``python -c``/stdin scripts crash in
  every child, and unguarded scripts launch recursively.
* **An environment of the rank's own**: multiprocessing's spawn execs with the parent's environ as
  it is at that moment and takes no env argument. Setting the run marker and ``--env`` values in
  ``os.environ`` for the start (what nbdist once did, under a lock) leaks them, for those
  milliseconds, into whatever else the kernel starts: a subprocess the notebook runs then carries
  the marker, ``%dist_ps`` lists it and ``%dist_stop`` kills it. So the one call that execs,
  ``multiprocessing.util.spawnv_passfds``, is replaced in that thread by a ``posix_spawn`` with the
  child's environment built as a dict. ``os.environ`` is never touched.

Other users of multiprocessing, and other threads, see no change. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading

__all__ = ["starting_ranks", "install_spawn_hooks", "spawn_with_env"]

_STARTING = threading.local()


def install_spawn_hooks() -> None:
    """Wrap multiprocessing's preparation data and exec once per process; idempotent."""
    import multiprocessing.spawn as mp_spawn
    import multiprocessing.util as mp_util

    original_prep = mp_spawn.get_preparation_data
    if not getattr(original_prep, "_nbdist", False):
        def get_preparation_data(name):
            data = original_prep(name)
            if getattr(_STARTING, "active", False):
                data.pop("init_main_from_path", None)
                data.pop("init_main_from_name", None)
            return data

        get_preparation_data._nbdist = True
        mp_spawn.get_preparation_data = get_preparation_data

    original_spawn = mp_util.spawnv_passfds
    if not getattr(original_spawn, "_nbdist", False):
        def spawnv_passfds(path, args, passfds):
            env = getattr(_STARTING, "env", None)
            if env is None:
                return original_spawn(path, args, passfds)
            return spawn_with_env(path, args, passfds, env)

        spawnv_passfds._nbdist = True
        # popen_spawn_posix calls it as util.spawnv_passfds, so the module attribute is the one to set.
        mp_util.spawnv_passfds = spawnv_passfds


@contextlib.contextmanager
def starting_ranks(env: dict[str, str]):
    """In this thread, for the block: spawned children skip ``__main__`` and exec with ``env``
    (the whole environment, not additions)."""
    install_spawn_hooks()
    _STARTING.active, _STARTING.env = True, dict(env)
    try:
        yield
    finally:
        _STARTING.active, _STARTING.env = False, None


def spawn_with_env(path: str, args: list, passfds, env: dict[str, str]) -> int:
    """``spawnv_passfds`` with an environment: exec ``path`` with ``args`` and ``env``; the child
    holds ``passfds`` (at the same numbers) and stdio, and none of this process's other descriptors.

    Each passed descriptor is re-made inheritable only in the child: a close-on-exec duplicate is
    ``dup2``-ed onto its number between the fork and the exec, so no other thread of the kernel
    ever sees an inheritable copy. Returns the child's pid.
    """
    passfds = sorted({int(fd) for fd in passfds})
    dups = [os.dup(fd) for fd in passfds]  # close-on-exec (PEP 446)
    try:
        for attempt in range(3):
            actions = [(os.POSIX_SPAWN_DUP2, dup, fd) for dup, fd in zip(dups, passfds)]
            # What spawnv_passfds's close_fds does: nothing else this process made inheritable leaks.
            actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in _inheritable_fds(exclude=set(passfds))]
            try:
                return os.posix_spawn(path, list(args), env, file_actions=actions)
            except OSError as exc:
                # An inheritable descriptor another thread closed after we listed it: list again.
                if exc.errno != errno.EBADF or attempt == 2:
                    raise
        raise AssertionError("unreachable")
    finally:
        for dup in dups:
            os.close(dup)


def _inheritable_fds(exclude: set[int]) -> list[int]:
    """This process's descriptors above stdio that a child would inherit, ``exclude`` left out."""
    out = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        fd = int(name)
        if fd <= 2 or fd in exclude:
            continue
        try:
            if os.get_inheritable(fd):
                out.append(fd)
        except OSError:  # closed since, or the listing's own descriptor
            continue
    return out
