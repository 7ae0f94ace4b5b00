"""The kernels of one world agree on its process groups (a session across nodes, torchrun --nnodes).

Each node's kernel drives only its own ranks, yet their groups span the world: a rank of another
node can raise, be stopped, or leave a collective without this kernel seeing it, and groups can
only be re-formed by every rank of the world at once, under the same generation. So the kernels
tell each other what they do, through the world's own store: the TCPStore that torchrun's c10d
rendezvous hosts at ``master_addr:master_port`` (nbdist runs no server of its own). The kernel
connects to it as a client; torch is imported here, in the kernel, only for such a inc.

Two kinds of event, numbered keys under ``nbdist-world/`` (an atomic counter orders them):

``stop``
    This node's part of the world's cell in generation *g* ended abnormally (a rank raised, the
    stop button, a timeout), so this kernel re-forms the world's groups to *g + 1*. Every other
    kernel stops its part of that cell too (SIGINT, release, as its own stop button would) or,
    idle already, re-forms with it (:func:`nbdist.session.recovery.catch_up`). Re-forming on *every* abnormal cell keeps
    the rule simple and safe: a collective one node issued and another skipped can never pair
    with a later one and give a wrong sum, because the old connections are gone.
``gone``
    This node's part was closed or lost: the world can't work without it, so the others stop
    their parts at once and say why, instead of waiting out a re-forming that can't complete.

One thread per kernel reads the events in order, blocked in the store's ``wait``. When node 0's
agent goes away, so does the store: that read fails, which the other kernels take as ``gone``.

A kernel that is SIGKILLed (or whose machine goes down) can't say ``gone``, and an idle world never
notices: its ranks only find out at the next collective, and re-forming then waits out its deadline
for ranks that will never come. So each wait ends every ``HEARTBEAT_S``: the kernel bumps its own
counter in the store and reads the others'. A kernel whose counter stood still for ``LOST_AFTER_S``
is taken as gone, and said so. That is a few store calls per kernel every 2 s.
"""

from __future__ import annotations

import contextlib
import json
import threading

from nbdist.errors import WorkerFailedError

__all__ = ["WorldLink", "link_kernels", "tell_world_gone", "on_world_event", "announce_stop"]

_PREFIX = "nbdist-world/"
HEARTBEAT_S = 2.0  # each kernel says it is alive this often (a store add), and reads the others'
LOST_AFTER_S = 15.0  # no word from a kernel for this long: it was killed, or its machine went down


class WorldLink:
    """This kernel's end of the agreement between the kernels of one world.

    Parameters
    ----------
    addr, port : str, int
        The world's store: torchrun's rendezvous endpoint (node 0 hosts it).
    node : int
        This kernel's node rank.
    on_event : callable
        ``on_event(event: dict)`` for every other node's event, on the reading thread.
    """

    def __init__(self, addr: str, port: int, node: int, on_event, nnodes: int = 1):
        self.addr, self.port, self.node, self.nnodes = addr, port, node, nnodes
        self._beats: dict[int, tuple[int, float]] = {}  # node -> (its counter, when it last moved)
        self._last_beat = float("-inf")
        self._on_event = on_event
        self._store = None
        self._connected = threading.Event()
        self._closing = False
        self.gone = False  # this node's part ended (a rank of it did): the cause is here, not elsewhere
        self.error: str | None = None

    def start(self) -> "WorldLink":
        """Connect (on a thread: importing torch in the kernel takes a second or two) and start reading."""
        threading.Thread(target=self._read_events, name=f"nbdist-world-node{self.node}", daemon=True).start()
        return self

    def _connect(self):
        from datetime import timedelta

        import torch.distributed as dist

        return dist.TCPStore(self.addr, self.port, is_master=False, timeout=timedelta(seconds=60))

    def announce(self, kind: str, wait: float = 60.0, **fields) -> None:
        """Tell every kernel of the world (this one reads it too, and skips it)."""
        if not self._connected.wait(wait) or self._store is None:
            return
        event = json.dumps({"kind": kind, "node": self.node, **fields})
        with contextlib.suppress(Exception):  # the store is gone: the reader says so
            number = self._store.add(_PREFIX + "count", 1)
            self._store.set(f"{_PREFIX}event{number}", event)

    def close(self) -> None:
        """Say that this node's part is gone; the reading thread ends on its own event."""
        self._closing = True
        self.announce("gone", wait=2.0, why="was closed")

    def _read_events(self) -> None:
        from datetime import timedelta

        try:
            self._store = self._connect()
            reader = self._connect()  # a wait holds its connection: announcing needs another
        except Exception as exc:
            self.error = f"could not reach the world's store at {self.addr}:{self.port} ({exc})"
            self._connected.set()
            return
        self._connected.set()
        number = 1
        while True:
            silent = self._beat()  # due every HEARTBEAT_S: events or not
            if silent is not None:
                self._on_event({"kind": "gone", "node": silent, "why": (
                    f"stopped answering: no word from its kernel for {LOST_AFTER_S:.0f} s "
                    f"(killed, or its machine went down)")})
                return
            key = f"{_PREFIX}event{number}"
            try:
                reader.wait([key], timedelta(seconds=HEARTBEAT_S))
                event = json.loads(reader.get(key))
            except Exception as exc:
                if "timeout" in str(exc).lower() and not self._closing:
                    continue
                if not self._closing:  # node 0's agent, which hosts the store, ended
                    self._on_event({"kind": "gone", "node": None, "why": str(exc).split(".")[0]})
                return
            number += 1
            if event["node"] == self.node:
                if self._closing and event["kind"] == "gone":
                    return
                continue
            self._on_event(event)

    def _beat(self) -> int | None:
        """Say this kernel is alive (at most every HEARTBEAT_S); the first other node whose kernel went
        silent, or None."""
        import time

        now = time.monotonic()
        if now - self._last_beat < HEARTBEAT_S:
            return None
        self._last_beat = now
        with contextlib.suppress(Exception):  # the store is gone: the next wait says so
            self._store.add(f"{_PREFIX}alive{self.node}", 1)
            for node in range(self.nnodes):
                if node == self.node:
                    continue
                count = self._store.add(f"{_PREFIX}alive{node}", 0)
                last = self._beats.get(node)
                if last is None or count != last[0]:
                    self._beats[node] = (count, now)
                elif count > 0 and now - last[1] > LOST_AFTER_S:
                    return node  # it had said it was alive, and then fell silent
        return None


def link_kernels(inc, engine) -> WorldLink:
    """Start incarnation ``inc``'s link to the other kernels of its world (torchrun's rendezvous store)."""

    def on_event(event):  # stopping or re-forming waits on the ranks: not on the reading thread
        threading.Thread(target=on_world_event, args=(inc, event), daemon=True).start()

    return WorldLink(engine.master_addr, engine.master_port, inc.options.node_rank, on_event,
                     inc.options.nnodes).start()


def tell_world_gone(inc, why: str) -> None:
    """This node's part is going (a rank ended, or it is stopped): tell the other nodes before the
    tree goes, as node 0's agent hosts the store and torchrun ends it soon after."""
    with inc.lock:
        link = inc.world
        if link is None or inc.status not in ("idle", "busy") or link.gone:
            return
        link.gone = True  # the cause is here: what the other nodes do next is their echo
    link.announce("gone", wait=0.5, why=why)


def announce_stop(inc, cell) -> None:
    """Tell the other kernels that this node's part of ``cell`` ended abnormally (once per cell)."""
    link = inc.world
    if link is None or cell.internal or cell.announced:
        return
    cell.announced = True
    if cell.failures:
        root = WorkerFailedError(cell.failures).root_cause  # the same rule as the cell's own error
        why = "a rank lost its peers" if root.secondary else f"rank {root.rank} {root.describe()}"
    else:
        why = "it was interrupted"
    threading.Thread(target=link.announce, args=("stop",), kwargs={"generation": inc.generation, "why": why},
                     daemon=True).start()


def on_world_event(inc, event: dict) -> None:
    """Another kernel's event: stop this node's part of the cell too, re-form with it, or stop here."""
    if inc.ended:  # an event for ranks that are gone: nothing here to act on
        return
    where = f"node {event['node']}"
    if event["kind"] == "gone":
        what = (f"{where}'s part of the world {event['why']}" if event["node"] is not None else
                f"the world's store closed ({event['why']}): node 0's torchrun agent ended, so a node's part of the "
                f"world was lost or closed")
        if inc.status in ("starting", "idle", "busy") and not inc.world.gone:
            inc.world.gone = True  # the cause is elsewhere: no echo back
            inc.lose(f"the session was stopped: {what}; this node's ranks can't go on without it, so their state "
                     f"is lost; {inc.restart_hint} on every node")
        return
    with inc.lock:
        if event["generation"] != inc.generation or inc.reform_due == inc.generation:
            return  # already re-formed past it, or already told
        inc.reform_due = inc.generation
        inc.stopped_by = f"{where}'s part of the cell stopped first: {event['why']}"
        inc.told.notify_all()
        cell = inc.active
        busy_user_cell = inc.status == "busy" and cell is not None and not cell.internal and not cell.done
        idle = inc.status == "idle"
        if busy_user_cell:
            cell.announced = True  # it is that node's stop: no need to tell it back
    if busy_user_cell:
        inc.interrupt_cell(cell)
    elif idle:
        inc.catch_up()  # nbdist.session.recovery.catch_up


