"""An incarnation's life as a state machine (nbdist.session.lifecycle): every allowed move is made,
every other one is refused, and the words Session.status shows keep their meaning."""

from __future__ import annotations

import itertools
import threading

import pytest

from nbdist.session.lifecycle import FINAL, MOVES, PUBLIC, STATES, IllegalMove, Life


def _life_at(state: str) -> Life:
    """A Life brought to ``state`` by allowed moves only (the shortest path from "starting")."""
    paths = {"starting": []}
    frontier = ["starting"]
    while frontier:
        here = frontier.pop(0)
        for there in sorted(MOVES[here]):
            if there not in paths:
                paths[there] = paths[here] + [there]
                frontier.append(there)
    life = Life()
    for step in paths[state]:
        assert life.move(step)
    assert life.state == state
    return life


def test_every_state_can_be_reached_and_every_move_is_walked():
    walked = set()
    for here, there in itertools.product(STATES, STATES):
        life = _life_at(here)
        if there in MOVES[here]:
            assert life.move(there) and life.state == there
            assert life.moves[-1] == (here, there)
            walked.add((here, there))
        else:
            with pytest.raises(IllegalMove, match=f"from {here} to {there}"):
                life.move(there)
            assert life.state == here, "a refused move changes nothing"
    assert walked == {(a, b) for a, targets in MOVES.items() for b in targets}
    print(f"{len(walked)} moves walked, {len(STATES) ** 2 - len(walked)} refused")


def test_the_final_states_have_no_way_out_but_closing():
    assert FINAL == {"lost", "closed"}
    assert MOVES["closed"] == frozenset() and MOVES["lost"] == {"closed"}
    life = _life_at("busy")
    assert life.end("lost") and life.ended
    assert not life.end("lost"), "lost twice is one loss"
    assert life.end("closed") and life.state == "closed"
    assert not life.end("lost"), "a closed incarnation is not lost afterwards"


def test_a_move_that_lost_a_race_is_no_error():
    life = _life_at("idle")
    assert life.end("closed")
    # A cell's end, or a recovery, that comes after a close: nothing to do, and no exception.
    assert not life.move("idle", only_from=("busy", "recovering"))
    assert not life.move("recovering", only_from=("busy",))
    assert life.state == "closed"


def test_session_status_keeps_its_words():
    assert {s: PUBLIC.get(s, s) for s in STATES} == {
        "starting": "starting", "idle": "idle", "busy": "busy", "recovering": "busy", "degraded": "degraded",
        "healing": "healing", "lost": "broken", "closed": "closed"}
    life = _life_at("recovering")
    assert life.public == "busy"


def test_generations_are_counted_under_the_lock():
    life = Life(threading.RLock())
    threads = [threading.Thread(target=lambda: [life.next_generation() for _ in range(1000)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert life.generation == 8000


def test_an_unknown_state_is_refused():
    with pytest.raises(IllegalMove, match="no such state"):
        Life().move("sleeping")
