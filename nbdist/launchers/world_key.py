"""The key that the kernels of an attached world sign their messages with, and how they come to share it.

Attached kernels were started by someone else's engine (torchrun, mpirun, srun), so nbdist can't hand
them a key the way it does to the processes it starts (through their environment). The sources, first
that works:

1. ``NBDIST_WORLD_KEY`` (hex of 32 bytes) in every kernel's environment: a job script exports it.
2. A shared folder, ``NBDIST_SHARED_DIR`` (default ``~/.nbdist/worlds``: a home folder is on the
   cluster's shared file system almost everywhere). Kernel 0 writes a fresh key into a 0600 file with
   an unguessable name there and tells the others the name (a name is no secret: only the owner can
   read the file, or write into the 0700 folder). Each kernel checks that the folder and the file are
   the user's own before it reads the key; kernel 0 removes the file once every kernel has it.
3. Neither: said once, and the world carries on unsigned, as before (the threat model names this).
   ``NBDIST_REQUIRE_SIGNED=1`` makes it an error instead.

Standard library only (the exchange is the caller's: an unsigned gather over the world's transport).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
import sys
import time

from nbdist.protocol.rundir import write_private
from nbdist.protocol.signing import WORLD_KEY_ENV, new_world_key, world_key_from_env

__all__ = ["SHARED_DIR_ENV", "REQUIRE_ENV", "shared_dir", "agree_world_key", "write_private_record",
           "read_private_record", "UnsharedKeyError"]

SHARED_DIR_ENV = "NBDIST_SHARED_DIR"
REQUIRE_ENV = "NBDIST_REQUIRE_SIGNED"
KEY_WAIT_S = 15.0  # NFS shows another node's new file within its attribute cache time (3-60 s)
_TOKEN = re.compile(r"^[0-9a-f]{32}$")
_SAID: set[str] = set()


class UnsharedKeyError(RuntimeError):
    """The kernels share no key and ``NBDIST_REQUIRE_SIGNED=1`` asks for one."""


def shared_dir(env=os.environ) -> tuple[str | None, str]:
    """``(folder, why_not)``: the user's own 0700 folder for keys, made if missing, or None and why."""
    folder = env.get(SHARED_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".nbdist", "worlds")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError as exc:
        return None, f"{folder} can't be made ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return None, f"{folder} is not a folder (a symlink someone could point elsewhere?)"
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None, f"{folder} is not yours alone (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
    return folder, ""


def write_private_record(folder: str, name: str, record: dict) -> str:
    """Write ``record`` as JSON into ``folder/name`` (0600, whole or not at all); return the path."""
    path = os.path.join(folder, name)
    write_private(path, json.dumps(record).encode())
    return path


def read_private_record(path: str, timeout: float, fresh=None) -> dict | None:
    """The JSON record at ``path`` once it exists (waiting up to ``timeout``), if it is the user's own
    regular file that nobody else can read or write; None otherwise. With ``fresh(record)``, a
    record it refuses is an old one, left by an earlier writer: the wait goes on for the new one."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                return None
            with open(path) as fh:
                record = json.load(fh)
            if fresh is None or fresh(record):
                return record
        except (FileNotFoundError, ValueError):  # not there yet, or being replaced
            pass
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def agree_world_key(rank: int, exchange, env=os.environ) -> bytes | None:
    """The world's key, the same on every kernel, or None (said once) where they can share none.

    ``exchange(value, topic)`` is an unsigned allgather between the kernels (every kernel calls
    this in the same order). Every kernel returns the same answer.
    """
    key = world_key_from_env(env)
    if key is not None:
        return key
    folder, why_not = shared_dir(env)
    token = None
    if rank == 0 and folder is not None:
        key = new_world_key()
        token = secrets.token_hex(16)
        write_private_record(folder, f"{token}.key", {"key": key.hex()})
    token0 = exchange(token, "world-key/name")[0]
    if rank != 0 and folder is not None and isinstance(token0, str) and _TOKEN.match(token0):
        record = read_private_record(os.path.join(folder, f"{token0}.key"), KEY_WAIT_S)
        key = bytes.fromhex(record["key"]) if record and isinstance(record.get("key"), str) else None
    have = exchange(key is not None, "world-key/have")
    if rank == 0 and token is not None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, f"{token}.key"))  # every kernel has read it (or never will)
    if all(h is True for h in have):
        return key
    missing = [r for r, h in enumerate(have) if h is not True]
    where = why_not or f"{folder} (on kernel 0) is not seen by kernel {', '.join(map(str, missing))}"
    message = (f"the kernels of this world share no signing key: {where}. Messages between them are not "
               f"signed, so anyone who can reach their store could inject one; export {WORLD_KEY_ENV} "
               f"(hex of 32 bytes) in the job, or set {SHARED_DIR_ENV} to a folder every node sees")
    if env.get(REQUIRE_ENV) == "1":
        raise UnsharedKeyError(f"nbdist: {message} ({REQUIRE_ENV}=1 asks for signing)")
    if message not in _SAID:
        _SAID.add(message)
        print(f"nbdist: {message}", file=sys.stderr, flush=True)
    return None
