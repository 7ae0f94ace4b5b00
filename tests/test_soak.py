"""Soak: seeded random walks of sessions and one-shot runs, invariants checked at every step
(tests/walks.py). A short walk runs on a fixed seed and on a random one (its seed is printed:
``NBDIST_SOAK_SEED=N`` replays it), and so does a heal walk (deaths during heals); long walks are
marked slow (``pytest -m slow``). A seed that found a fault becomes a regression test below."""

from __future__ import annotations

import os
import random

import pytest
from walks import HealWalk, RunWalk, SessionWalk

pytestmark = pytest.mark.usefixtures("warm_template")

FIXED_SEED = 20261203
# Seeds that once found a fault, kept as regressions (the fault, and where it was fixed, beside each).
# 559694983: after a heal, the new rank numbered its copied optimizers as it first stepped them, not as
# the donor had, so a later stop compared one optimizer's steps with another's ("apart").
# 446660353: with 2 ranks, the last survivor killed during a heal left only the replacement alive,
# and the heal waited out its 90 s connect deadline (rank_deaths.note_rank_death, healing._undo);
# later, the reply reader took the healed rank's channel for the dead one's, whose id() it got
# (reply_reader keys the channels themselves).
# 135951848: a stop inside an import cut torch._dynamo's import in half (worker/import_guard).
# 483411490: a rank still in its first FSDP step's compute when the stop came got 0.05 s to reach the
# agreed point and was stopped where it was, a step behind (agreed_stop.BEHIND_WINDOW_S).
# 751679988: a survivor killed during a heal left rank 0 in gloo's connect, waiting for it, past the
# kernel's 90 s, and the session was lost (worker/member_arrival: the kernel calls the re-forming
# off); then the heal again found the undone heal's replacement not yet reaped (healing._undo).
REGRESSIONS: list = [559694983, 446660353, 135951848, 483411490, 751679988]
# Heal walks (HealWalk: 12 steps, 3 ranks) that failed beside a CPU hog:
# 425775233: gloo's connect to a peer that died waited five times its timeout, past the kernel's 90 s,
# and the session was lost (worker/member_arrival: Reforming.connect stops waiting).
# 381249035: a heal from a rank healed before left out the training step (its code had lost its cell's
# file in the heal's pickle: worker/namespace_copy), and the next training cell raised NameError.
# 1063083760: ranks slower than their peer into an FSDP2 step were stopped inside it, after the peer
# had stopped at the agreed point a step ahead (session/agreed_stop.await_stop_point).
HEAL_REGRESSIONS: list = [425775233, 381249035, 1063083760]


def _random_seed() -> int:
    seed = int(os.environ.get("NBDIST_SOAK_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"soak seed: {seed} (NBDIST_SOAK_SEED={seed} replays it)")
    return seed


@pytest.mark.timeout(900)
@pytest.mark.parametrize("which", ["fixed", "random"])
def test_a_short_session_walk(which):
    SessionWalk(FIXED_SEED if which == "fixed" else _random_seed(), "warm").run(60)


@pytest.mark.timeout(600)
def test_a_short_run_walk():
    RunWalk(_random_seed(), "warm").run(25)


@pytest.mark.timeout(600)
def test_a_heal_walk():
    HealWalk(_random_seed(), "warm").run(12)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("walk, seed", [(SessionWalk, s) for s in REGRESSIONS] + [(HealWalk, s) for s in HEAL_REGRESSIONS],
                         ids=[str(s) for s in REGRESSIONS] + [f"heal-{s}" for s in HEAL_REGRESSIONS])
def test_a_walk_that_once_failed(walk, seed):
    walk(seed, "warm").run(60 if walk is SessionWalk else 12)


@pytest.mark.slow
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("start_method", ["spawn", "warm"])
def test_a_long_session_walk(start_method):
    SessionWalk(_random_seed(), start_method).run(1000)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("start_method", ["spawn", "warm"])
def test_a_long_run_walk(start_method):
    RunWalk(_random_seed(), start_method).run(200)
