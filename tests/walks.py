"""Seeded random walks of what a person does with nbdist over an afternoon, with invariants checked at
every step. The soak tests (tests/test_soak.py) run them; a failure prints its seed and the steps
so far, and replays exactly with the same seed.

:class:`SessionWalk` walks a live session: cells that change state, collectives with known
results, targeted cells, push and pull, a rank that raises while its peers wait, the stop button in
a Python loop and in DDP and FSDP2 steps at random moments, timeouts, a rank killed from outside and
one that dies in a cell, restarts, and a restart while the ranks still start. :class:`RunWalk` does
the same for one-shot runs with random faults.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time

import rankfns
from conftest import KEPT_TEMPLATES, find_marked_leftovers, wait_for

import nbdist
from nbdist.errors import RankGoneError, RunStoppedError, RunTimeoutError, WorkerFailedError

__all__ = ["SessionWalk", "HealWalk", "RunWalk"]

SETUP = "import os, time, itertools, torch, torch.distributed as dist\nrank = dist.get_rank()\nstate = {}\nspins = 0"
DDP = """
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
ddp = DDP(torch.nn.Linear(8, 1))
ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
ddp_x = torch.randn(32, 8, generator=torch.Generator().manual_seed(rank))
def ddp_step():
    ddp_opt.zero_grad()
    loss = ((ddp(ddp_x) - ddp_x.sum(1, keepdim=True)) ** 2).mean()
    loss.backward()
    ddp_opt.step()
    return loss.item()
"""
FSDP = """
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
fsdp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
for layer in fsdp[::2]:
    fully_shard(layer)
fully_shard(fsdp)
fsdp_opt = torch.optim.Adam(fsdp.parameters(), lr=0.01)
fsdp_x = torch.randn(32, 8, generator=torch.Generator().manual_seed(rank))
def fsdp_step():
    fsdp_opt.zero_grad()
    loss = ((fsdp(fsdp_x) - fsdp_x.sum(1, keepdim=True)) ** 2).mean()
    loss.backward()
    fsdp_opt.step()
    return loss.item()
"""


class WalkFailed(AssertionError):
    pass


def _try(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the walk looks at what came back
        return exc


class SessionWalk:
    """A live session and a model of what its ranks hold; ``run(steps)`` walks it."""

    def __init__(self, seed: int, start_method: str, nprocs: int | None = None):
        self.seed, self.rng = seed, random.Random(seed)
        self.nprocs = nprocs or self.rng.choice((2, 3))
        self.start_method = start_method
        self.session = nbdist.Session(nprocs=self.nprocs, start_method=start_method)
        self.trail: list[str] = []
        self.models: set[str] = set()
        self.expected: dict[str, dict[int, object]] = {}
        self.counter = 0
        self.steps = [
            (6, self.set_state), (4, self.collective), (3, self.targeted), (2, self.push_and_pull),
            (2, self.raise_with_peers_waiting), (2, self.stop_python_loop), (2, self.stop_training),
            (1, self.time_out), (1, self.kill_a_rank_from_outside), (1, self.die_in_a_cell), (1, self.restart),
            (1, self.restart_while_starting), (2, self.kill_and_heal), (1, self.kill_during_heal),
        ]

    # ---- walking ---------------------------------------------------------------------------
    def run(self, count: int) -> None:
        self._fresh()
        weights = [w for w, _ in self.steps]
        try:
            for i in range(count):
                _, step = self.rng.choices(self.steps, weights)[0]
                t0 = time.monotonic()
                step()
                took = time.monotonic() - t0
                self.trail.append(f"{i}: {step.__name__} ({took:.2f} s)")
                self.check_invariants(step.__name__, took)
        except BaseException as exc:
            raise WalkFailed(f"session walk, seed {self.seed} ({self.start_method}, {self.nprocs} ranks) failed at "
                             f"step {len(self.trail)}: {type(exc).__name__}: {exc}\nsteps so far:\n" +
                             "\n".join(self.trail[-25:])) from exc
        finally:
            sid = self.session.session_id
            self.session.close()
            wait_for(lambda: not [m for m in find_marked_leftovers(sid)], 5, what="the walk's session to go")

    def _fresh(self) -> None:
        assert self.session.wait_ready(120), "the ranks came up"
        self.session.execute(SETUP, timeout=60)
        self.models.clear()
        self.expected.clear()

    @property
    def ranks(self) -> list[int]:
        return list(range(self.nprocs))

    def check_invariants(self, step: str, took: float) -> None:
        s = self.session
        # A heal under fire fails at once, or waits on no deadline of its own: never a call's 60 s
        bound = 55.0 if step == "kill_during_heal" else 90.0 if "restart" in step or "die" in step or "kill" in step \
            else 40.0
        assert took < bound, f"{step} took {took:.1f} s (bound {bound:g} s)"
        assert s.status == "idle", f"after {step} the session is {s.status}: {s.lost_reason}"
        held = s.execute("{k: v for k, v in state.items()}", timeout=30)
        want = {r: {k: v[r] for k, v in self.expected.items() if r in v} for r in self.ranks}
        assert held == want, f"after {step} the ranks hold {held}, expected {want}"
        strays = [m for m in find_marked_leftovers() if m.run_id != s.session_id and m.pid not in KEPT_TEMPLATES]
        if strays:  # what a restart ended may take a moment to be reaped
            wait_for(lambda: not [m for m in find_marked_leftovers()
                                  if m.run_id != s.session_id and m.pid not in KEPT_TEMPLATES], 5,
                     what=f"no nbdist process but this session's after {step}: {strays}")

    # ---- steps -----------------------------------------------------------------------------
    def set_state(self) -> None:
        self.counter += 1
        key, value = f"k{self.counter % 7}", self.rng.randint(0, 1000)
        got = self.session.execute(f"state[{key!r}] = {value} + rank\nstate[{key!r}]", timeout=30)
        assert got == {r: value + r for r in self.ranks}, got
        self.expected[key] = {r: value + r for r in self.ranks}

    def collective(self) -> None:
        c = self.rng.randint(1, 9)
        got = self.session.execute(f"t = torch.ones(1) * (rank + 1) * {c}\ndist.all_reduce(t)\nt.item()", timeout=30)
        total = float(c * self.nprocs * (self.nprocs + 1) // 2)
        assert got == {r: total for r in self.ranks}, got

    def targeted(self) -> None:
        some = sorted(self.rng.sample(self.ranks, self.rng.randint(1, self.nprocs)))
        value = self.rng.randint(0, 99)
        got = self.session.execute(f"state['only'] = {value} * 10 + rank\nrank", ranks=some, timeout=30)
        assert got == {r: r for r in some}, got
        self.expected.setdefault("only", {}).update({r: value * 10 + r for r in some})

    def push_and_pull(self) -> None:
        value = [self.rng.random() for _ in range(self.rng.randint(1, 5))]
        self.session.push(pushed=value)
        assert self.session.pull("pushed") == {r: value for r in self.ranks}

    def raise_with_peers_waiting(self) -> None:
        bad = self.rng.choice(self.ranks)
        delay = self.rng.uniform(0.05, 0.6)
        try:
            self.session.execute(f"if rank == {bad}:\n    time.sleep({delay})\n    raise ValueError('bad shard {bad}')\n"
                                 f"dist.barrier()", timeout=60)
        except WorkerFailedError as exc:
            assert exc.rank == bad and f"bad shard {bad}" in str(exc), str(exc)
            self._resync_if_told(str(exc))
        else:
            raise AssertionError("the raise was not reported")

    def stop_python_loop(self) -> None:
        cell = self.session.execute("for i in itertools.count():\n    spins += 1", join=False)
        self._stop(cell, self.rng.uniform(0.05, 1.0))

    def stop_training(self) -> None:
        kind = self.rng.choice(("ddp", "fsdp"))
        if kind not in self.models:
            self.session.execute(DDP if kind == "ddp" else FSDP, timeout=60)
            self.models.add(kind)
        cell = self.session.execute(f"while True:\n    {kind}_step()", join=False)
        said = self._stop(cell, self.rng.uniform(0.05, 1.5))
        # Every rank stopped at the same collective: the replicas are equal, and every rank trains.
        assert "differ" not in said, f"a stop in a {kind} loop left the replicas apart: {said}"
        before = self._replicas(kind)
        losses = self.session.execute(f"[{kind}_step() for _ in range(3)][-1]", timeout=60)
        assert all(v == v for v in losses.values()), f"{kind} trains on after the stop: {losses}"
        after = self._replicas(kind)
        assert after != before, f"every rank trained after the stop ({said}): {before} -> {after}"
        assert self.session.execute("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()", timeout=30) == \
            {r: float(self.nprocs) for r in self.ranks}

    def _replicas(self, kind: str):
        """What must be equal on every rank: a DDP model's parameters (bit-equal: its SGD has no steps to
        count); of an FSDP2 model (whose shards differ by design), its Adam's steps. Fails if they differ."""
        code = ("sum(p.double().sum().item() for p in ddp.parameters())" if kind == "ddp"
                else "sorted({float(s['step']) for s in fsdp_opt.state.values()})")
        held = self.session.execute(code, timeout=30)
        assert len(set(map(repr, held.values()))) == 1, f"the {kind} replicas differ between ranks: {held}"
        return held[0]

    def _stop(self, cell, delay: float) -> str:
        time.sleep(delay)  # from the send: on a busy box the stop may come before a rank began the cell
        t0 = time.monotonic()
        cell.interrupt()
        try:
            cell.wait(30)
        except RunStoppedError as exc:
            assert "idle again, their state kept" in str(exc), str(exc)
            said = str(exc.report)
            self._resync_if_told(said)
        else:
            raise AssertionError("a stopped cell did not say it was stopped")
        assert time.monotonic() - t0 < 8.0, f"the stop took {time.monotonic() - t0:.1f} s"
        return said

    def _resync_if_told(self, said: str) -> None:
        if "now differ between ranks" in said:  # what the message offers: %dist_sync
            assert "re-synced 1 DDP model" in self.session.sync(self.rng.choice(self.ranks))

    def time_out(self) -> None:
        limit = self.rng.uniform(0.3, 1.5)
        t0 = time.monotonic()
        try:
            self.session.execute("while True:\n    time.sleep(0.01)", timeout=limit)
        except RunStoppedError:
            pass
        else:
            raise AssertionError("the timeout did not stop the cell")
        assert time.monotonic() - t0 < limit + 8.0

    def kill_a_rank_from_outside(self) -> None:
        victim = self.session.pids[self.rng.choice(self.ranks)]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: self.session.status == "degraded", 15, what="the session to notice the dead rank")
        try:
            self.session.execute("1")
        except RankGoneError as exc:
            assert "SIGKILL" in str(exc) and "restart()" in str(exc) and "heal()" in str(exc), str(exc)
        else:
            raise AssertionError("a degraded session took a cell that needs the dead rank")
        self.restart()

    def die_in_a_cell(self) -> None:
        bad = self.rng.choice(self.ranks)
        how = self.rng.choice(("os._exit(3)", "os.kill(os.getpid(), 9)"))
        try:
            self.session.execute(f"if rank == {bad}:\n    time.sleep({self.rng.uniform(0, 0.4)})\n    {how}\n"
                                 f"dist.barrier()", timeout=60)
        except WorkerFailedError as exc:  # the survivors keep their state: the session is degraded
            text = str(exc)
            assert f"rank {bad} failed first" in text and text.count("failed first") == 1, text
            assert self.session.status == "degraded", self.session.status
        else:
            raise AssertionError("a rank died and nobody said so")
        self.restart()

    def kill_and_heal(self) -> None:
        """A random rank killed, idle or in a cell of collectives; the heal brings it back from a random donor."""
        dead = self.rng.choice(self.ranks)
        victim = self.session.pids[dead]
        if self.rng.random() < 0.5:
            cell = self.session.execute("while True:\n    dist.barrier()\n    time.sleep(0.005)", join=False)
            time.sleep(self.rng.uniform(0.05, 0.6))
            os.kill(victim, signal.SIGKILL)
            try:
                cell.wait(30)
            except WorkerFailedError as exc:
                assert f"rank {dead} failed first: killed by SIGKILL" in str(exc), str(exc)
        else:
            os.kill(victim, signal.SIGKILL)
        wait_for(lambda: self.session.status == "degraded", 20, what=f"the session to be degraded (rank {dead} killed)")
        donor = self.rng.choice([r for r in self.ranks if r != dead])
        report = self.session.heal(donor)
        assert report.healed == [dead] and report.donor == donor, report
        self._restore([dead])

    def kill_during_heal(self) -> None:
        """A rank killed, then another one (a survivor, the donor, or the new rank) while the heal runs:
        the heal succeeds or fails, never hangs; healing again (at most twice more) brings every rank back."""
        first = self.rng.choice(self.ranks)
        os.kill(self.session.pids[first], signal.SIGKILL)
        wait_for(lambda: self.session.status == "degraded", 20, what="the session to be degraded")
        second = self.rng.choice(self.ranks)
        outcome: dict = {}
        thread = threading.Thread(target=lambda: outcome.update(report=_try(self.session.heal)), daemon=True)
        thread.start()
        time.sleep(self.rng.uniform(0.0, 1.0))
        pid = self.session.pids.get(second)
        if pid is not None and self.session.status != "broken":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        thread.join(150)
        assert not thread.is_alive(), "the heal hung after a rank died under it"
        if pid is not None:  # its death is noticed within a tick of the monitor: wait for it to be said
            wait_for(lambda: pid not in self.session.pids.values() or self.session.status == "broken", 15,
                     what=f"rank {second}'s death to be noticed")
        healed = {first}
        for _ in range(3):
            # A death is in Session.gone at once; the survivors are told (degraded) within a moment.
            wait_for(lambda: self.session.status in ("degraded", "broken") or (self.session.status == "idle" and
                                                                                not self.session.gone),
                     30, what=f"the heal's outcome to settle (killed {first}, then {second}: {self.session!r}, "
                              f"{self.session._current.life.moves[-6:]}, {outcome})")
            if self.session.status == "broken":  # only where the two were every rank there was
                assert set(self.ranks) <= {first, second}, f"killed {first}, then {second}: {self.session.lost_reason}"
                self.restart()
                return
            if self.session.status == "idle":
                break
            healed |= set(self.session.gone)
            self.session.heal()
        else:
            raise AssertionError(f"three heals did not bring the session back: {self.session.status}")
        if isinstance(outcome.get("report"), BaseException):
            self.trail.append(f"   (the heal under fire failed: {str(outcome['report'])[:200]})")
        self._restore(sorted(healed))

    def _restore(self, healed: list[int]) -> None:
        """What the heal rightly did not copy (rank-specific), set on the healed ranks as the cells had."""
        s = self.session
        for r in healed:
            s.execute("rank = dist.get_rank()\nspins = 0", ranks=[r], timeout=30)
            s.push(ranks=[r], state={k: v[r] for k, v in self.expected.items() if r in v})
            if "ddp" in self.models:
                s.execute("ddp_x = torch.randn(32, 8, generator=torch.Generator().manual_seed(rank))", ranks=[r],
                          timeout=30)
        if "fsdp" in self.models:  # its shards are rank-specific: the walk builds it again when it next needs it
            s.execute("for _n in ('fsdp', 'fsdp_opt', 'fsdp_x', 'fsdp_step'):\n    globals().pop(_n, None)", timeout=30)
            self.models.discard("fsdp")
        if "ddp" in self.models:  # a death mid-step may leave the survivors apart: the message says so
            s.sync(self.rng.choice(self.ranks))
            self._replicas("ddp")

    def restart(self) -> None:
        self.session.restart()
        self._fresh()

    def restart_while_starting(self) -> None:
        self.session.restart()
        time.sleep(self.rng.uniform(0, 0.5))
        self.session.restart()  # the first new ranks are still coming up
        self._fresh()


class HealWalk(SessionWalk):
    """A session walk mostly of deaths during heals, on 3 ranks (a heal from one survivor, from a healed
    rank, a third death while it re-forms), between training stops. Run in a loop beside a CPU hog,
    it found in ten minutes what the mixed walk had met once in a CI run: gloo's connect waiting past
    the kernel's deadline, a heal from a healed rank leaving the cells' functions out, and a stop that
    left a slower rank a step behind."""

    def __init__(self, seed: int, start_method: str):
        super().__init__(seed, start_method, nprocs=3)
        self.steps = [(3, self.kill_during_heal), (1, self.stop_training), (1, self.set_state), (1, self.collective)]


class RunWalk:
    """One-shot runs with random faults; after each, the right answer or error, and nothing left."""

    def __init__(self, seed: int, start_method: str):
        self.seed, self.rng = seed, random.Random(seed)
        self.start_method = start_method
        self.trail: list[str] = []

    def run(self, count: int) -> None:
        steps = [self.succeed, self.raise_on_a_rank, self.die_on_a_rank, self.time_out, self.interrupt]
        try:
            for i in range(count):
                step = self.rng.choice(steps)
                nprocs = self.rng.choice((2, 3, 4))
                t0 = time.monotonic()
                run_id = step(nprocs)
                self.trail.append(f"{i}: {step.__name__} on {nprocs} ranks ({time.monotonic() - t0:.2f} s)")
                wait_for(lambda: not find_marked_leftovers(run_id), 5, what=f"nothing left of {run_id}")
        except BaseException as exc:
            raise WalkFailed(f"run walk, seed {self.seed} ({self.start_method}) failed at step {len(self.trail)}: "
                             f"{type(exc).__name__}: {exc}\nsteps so far:\n" + "\n".join(self.trail[-25:])) from exc

    def _launch(self, fn, *args, nprocs, **kw):
        return nbdist.launch(fn, *args, nprocs=nprocs, join=False, start_method=self.start_method, **kw)

    def succeed(self, nprocs):
        run = self._launch(rankfns.rank_sum, nprocs=nprocs)
        assert run.wait(90) == {r: float(nprocs * (nprocs + 1) // 2) for r in range(nprocs)}
        return run.run_id

    def raise_on_a_rank(self, nprocs):
        bad = self.rng.randrange(nprocs)
        run = self._launch(rankfns.fail_on, bad, "raise", self.rng.uniform(0, 0.5), nprocs=nprocs)
        try:
            run.wait(90)
        except WorkerFailedError as exc:
            assert exc.rank == bad and f"boom on rank {bad}" in str(exc), str(exc)
        return run.run_id

    def die_on_a_rank(self, nprocs):
        bad, how = self.rng.randrange(nprocs), self.rng.choice(("exit", "signal", "segv"))
        run = self._launch(rankfns.fail_on, bad, how, self.rng.uniform(0, 0.5), nprocs=nprocs)
        try:
            run.wait(90)
        except WorkerFailedError as exc:
            assert exc.rank == bad, str(exc)
            want = {"exit": "exit code 3", "signal": "SIGKILL", "segv": "SIGSEGV"}[how]
            assert want in str(exc), str(exc)
        return run.run_id

    def time_out(self, nprocs):
        run = self._launch(rankfns.hang, nprocs=nprocs, timeout=self.rng.uniform(3.0, 6.0), init_process_group=False)
        try:
            run.wait(90)
        except RunTimeoutError as exc:
            assert "timed out after" in str(exc), str(exc)
        return run.run_id

    def interrupt(self, nprocs):
        run = self._launch(rankfns.hang, nprocs=nprocs, init_process_group=False)
        time.sleep(self.rng.uniform(0, 3.0))  # while the ranks start, or once they run
        report = run.interrupt()
        assert run.status == "interrupted" and not report.survivors, (run.status, report)
        return run.run_id
