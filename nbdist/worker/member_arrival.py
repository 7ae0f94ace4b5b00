"""A group's re-forming on one rank, which a member's death calls off on every member within moments.

A group re-forms (after a stop, a death, or at a heal) by making its inner torch group again, and
gloo's constructor waits in C, on the store, for every member's address: a member that died before
it published one left the others there until gloo's timeout, with nothing able to free them (soak
seed 751679988: a survivor killed mid-heal kept rank 0 there past the kernel's 90 s, and the session
was lost). So a re-forming goes through a store connection of the rank's own (``Store.clone()``),
in two parts:

* **arrival**: each member says it came (its pid and host) under the generation's prefix, and
  waits there until every member did (the store wakes the wait: nothing polls on the happy path);
* **connect**: gloo connects the members, all alive a moment ago. gloo's constructor runs in a
  thread of its own, which the rank stops waiting for once the re-forming is given up or its
  deadline passed: a pair that waits for its peer to connect waits five times gloo's timeout (seen
  as 100 s for a 20 s timeout, past the kernel's 90 s: soak seed 425775233, under load), on a
  condition that no socket of ours can end. The thread ends by gloo's timeout, unwaited.

A watcher thread shuts that connection down, failing whichever wait is on it, once the re-forming
must be given up: the kernel called the generation off (it writes
:data:`~nbdist.protocol.session_channel.REFORM_CALLED_OFF_FILE` once a rank the re-forming needs
dies), a member on this machine is seen dead (sooner than the kernel, whose monitor ticks), or
another member gave up (it says so in the store). Members never disagree for long: one that gives
up while the others connect would otherwise leave them waiting for its address.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
import threading
import time
from datetime import timedelta

from nbdist.protocol.session_channel import REFORM_CALLED_OFF_FILE
from nbdist.worker.socket_cut import describe_stuck_thread, shut_down_sockets, socket_inodes

__all__ = ["ReformCalledOff", "Reforming", "watch_calls_off", "AFTER_ARRIVAL_S"]

# Once every member arrived, gloo's full mesh connects in well under a second (32 ranks on two busy
# cores: ~2 s). The kernel's own deadline for a re-forming leaves room for this past the arrival.
AFTER_ARRIVAL_S = 20.0
MIN_CONNECT_S = 5.0
# gloo's connect raises by its own timeout, but for a pair whose peer never connects to it; past its
# timeout by this much, the rank stops waiting for it (see the module's docstring).
CONNECT_GRACE_S = 2.0
# How often a watcher looks whether its re-forming must be given up: it costs the happy path
# nothing (the wait itself is woken by the store), and 32 ranks' looks cost the store host little.
_WATCH_POLL_S = 0.025
_GAVE_UP = "gave-up"  # the store key by which a member that gave up tells the others
_SESSION_DIR: list[str] = []
_WHERE: list[str] = []


class ReformCalledOff(RuntimeError):
    """The re-forming was given up: a member it needs died (or another member gave up)."""


def watch_calls_off(session_dir: str) -> None:
    """Where the kernel calls re-formings off: the session's dir (its ranks all see it, on one machine)."""
    _SESSION_DIR[:] = [session_dir]


class Reforming:
    """One group's re-forming under one generation, on this rank.

    Parameters
    ----------
    store : torch.distributed.Store
        The group's store under the generation's prefix.
    rank : int
        This rank's place in the group.
    members : tuple
        The members' global ranks, in group order (what messages name).
    generation : int
        What the kernel calls off.
    label : str
        The group, in messages (``"the default group"``).
    """

    def __init__(self, store, rank: int, members: tuple, generation: int, label: str):
        self.store, self.rank, self.members, self.generation, self.label = store, rank, members, generation, label
        self._keys = [f"arrived/{i}" for i in range(len(members))]
        self._arrivals: list = []
        self._said: list[str] = []  # the watcher's reason, once it cut this rank's own connection
        self._cutting = threading.Lock()  # the watcher's cut against the main thread's end of watching

    @contextlib.contextmanager
    def watched(self, group_store):
        """A connection of this rank's own to ``group_store`` (``Store.clone()``) for both parts, which
        a watcher thread shuts down, failing the wait on it, once the re-forming must be given up;
        that failure, as any other, raises :class:`ReformCalledOff` after telling the other members.
        A store that can't be cloned (no TCP) is given as it is, unwatched."""
        before = set(socket_inodes().values())
        try:
            own = group_store.clone()
        except Exception:  # noqa: BLE001 - HashStore, FileStore: nothing that a death could leave waiting
            own = None
        if own is None:
            yield group_store
            return
        stop = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(before, stop), name="nbdist-reform-watch", daemon=True)
        watcher.start()
        try:
            yield own
        except ReformCalledOff:
            raise
        except Exception as exc:
            self._stop_watching(stop, watcher)
            if self._said:
                raise self._called_off(self._said[0]) from exc
            self.give_up(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
        finally:
            self._stop_watching(stop, watcher)
        if self._said:  # gloo connected here, but the watcher gave up for the others: fail alike
            raise self._called_off(self._said[0])

    def _stop_watching(self, stop: threading.Event, watcher: threading.Thread) -> None:
        """The watcher stops, at once (no poll to wait out), and cuts nothing from now on."""
        with self._cutting:
            stop.set()
        watcher.join(5)

    def await_members(self, own, deadline: float) -> float:
        """Say this member arrived, through ``own`` (this rank's connection, under the generation's
        prefix), and wait there until every member did; returns how many seconds gloo may then take
        to connect. Raises :class:`ReformCalledOff` when given up, or when someone never came by
        ``deadline`` (``time.monotonic()``), naming who."""
        own.set(self._keys[self.rank], f"{os.getpid()}@{_where()}".encode())
        # The store wakes the wait as the last member arrives: no poll on the happy path. A group
        # after the first gets MIN_CONNECT_S at least: its members come from the last one together.
        try:
            own.wait(self._keys, timedelta(seconds=max(MIN_CONNECT_S, deadline - time.monotonic())))
        except Exception:
            if self._said:
                raise
            absent = [self.members[i] for i, key in enumerate(self._keys) if not self.store.check([key])]
            if not absent:
                raise
            self.give_up(f"rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} never came to it")
        self._arrivals = own.multi_get(self._keys)
        why = _dead_here(self.members, self._arrivals)  # one may have died while it waited for the last
        if why is not None:
            self.give_up(why)
        return max(MIN_CONNECT_S, min(AFTER_ARRIVAL_S, deadline - time.monotonic()))

    def connect(self, make, connect_s: float):
        """``make()`` (gloo's connect, within ``connect_s``) in a thread of its own, waited for until it
        returns, the re-forming is given up (the watcher's word), or ``connect_s`` +
        :data:`CONNECT_GRACE_S` passed; its result, or what it raised. Raises
        :class:`ReformCalledOff` when it is given up for either reason, leaving the thread to end by
        gloo's own timeout."""
        done, out = threading.Event(), {}

        def run():
            try:
                out["made"] = make()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, or dropped there
                out["error"] = exc
            finally:
                done.set()

        thread = threading.Thread(target=run, name="nbdist-gloo-connect", daemon=True)
        thread.start()
        deadline = time.monotonic() + connect_s + CONNECT_GRACE_S
        while not done.wait(min(_WATCH_POLL_S * 4, max(0.0, deadline - time.monotonic()))):
            why = self._said[0] if self._said else None
            if why is None and time.monotonic() >= deadline:
                why = (f"gloo's connect did not end within its {connect_s:.0f} s, with every member alive as far "
                       f"as rank {self.members[self.rank]} sees")
            if why is not None:
                _log(f"{self.label}: gloo's connect left to end by its own timeout ({why}); it waits in "
                     f"{describe_stuck_thread(thread.native_id)}")
                self.give_up(why)
        if "error" in out:
            raise out["error"]
        return out["made"]

    def why_give_up(self) -> str | None:
        """Why this re-forming can't complete, as far as this rank can tell now; else None."""
        if self.store.check([_GAVE_UP]):
            return self.store.get(_GAVE_UP).decode()
        if _SESSION_DIR:
            path = os.path.join(_SESSION_DIR[0], REFORM_CALLED_OFF_FILE.format(generation=self.generation))
            with contextlib.suppress(OSError), open(path, encoding="utf-8") as fh:
                return fh.read().strip() or "a member died"
        return _dead_here(self.members, self._arrivals)

    def give_up(self, why: str):
        """Tell the other members (they stop waiting too), and raise :class:`ReformCalledOff`."""
        with contextlib.suppress(Exception):  # the store itself failing: they find out by their deadline
            self.store.compare_set(_GAVE_UP, "", why)  # the first reason stays
        raise self._called_off(why)

    def _called_off(self, why: str) -> ReformCalledOff:
        return ReformCalledOff(f"nbdist: re-forming {self.label} was called off: {why}")

    def _watch(self, before: set, stop: threading.Event) -> None:
        """Until ``stop``: once the re-forming must be given up, say why and shut down every socket
        opened since ``before`` (this rank's store connection, and gloo's pairs: a connect to a dead
        peer's address retries until gloo's timeout, and a CI run saw one outlast the kernel's 90 s),
        and go on shutting down the ones gloo opens again, until the main thread stops watching."""
        while not stop.wait(_WATCH_POLL_S):
            if not self._said:
                try:
                    why = self.why_give_up()
                except Exception:  # noqa: BLE001 - the store went: the wait on it fails by itself
                    why = None
                if why is None:
                    continue
            with self._cutting:  # never once the main thread has stopped watching (it connected)
                if stop.is_set():
                    return
                if not self._said:
                    self._said.append(why)
                    _log(f"re-forming {self.label} (generation {self.generation}) given up: {why}")
                    with contextlib.suppress(Exception):
                        self.store.compare_set(_GAVE_UP, "", why)
                shut_down_sockets({fd: inode for fd, inode in socket_inodes().items() if inode not in before})


def _log(line: str) -> None:
    """A line in the rank's log (its stderr), for whoever reads why a re-forming ended as it did."""
    with contextlib.suppress(Exception):
        print(f"nbdist: {line}", file=sys.stderr, flush=True)


def _where() -> str:
    """This process's machine and PID namespace, as a peer's arrival must say it for its pid to be
    looked up here: the hostname alone is shared by containers on one host (host networking)."""
    if not _WHERE:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
                boot = fh.read().strip()
            namespace = os.stat("/proc/self/ns/pid").st_ino
        except OSError:  # no /proc to look in: no peer is ever judged from here
            boot, namespace = secrets.token_hex(8), 0
        _WHERE.append(f"{socket.gethostname()}|{boot}|{namespace}")
    return _WHERE[0]


def _dead_here(members: tuple, arrivals: list) -> str | None:
    """``"rank 1 (pid 123) died"``: the first member whose arrival says it runs on this machine, in
    this PID namespace, and whose process has ended since (gone, or a zombie its parent has not
    reaped yet); else None."""
    here = _where()
    for grank, said in zip(members, arrivals):
        pid, _, where = said.decode().partition("@")
        if where != here or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
                state = fh.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            state = "X"
        if state in ("Z", "X", "x"):
            return f"rank {grank} (pid {pid}) died"
    return None
