"""Session affinity of the router (pure part): sticky, least-loaded, moves off dead engines, bounded."""

import pytest

from molt_hydra.rollout.generation import EngineFailure
from molt_hydra.rollout.router import Router


def test_new_sessions_go_to_the_least_loaded_engine_and_stay_there():
    a = Router([None] * 3)
    a.in_flight = [2, 0, 1]
    assert a.pick("s1") == 1
    a.in_flight = [0, 5, 5]
    assert a.pick("s1") == 1  # sticky although engine 0 is now idle
    assert a.pick("s2") == 0


def test_ties_break_to_the_lowest_index():
    assert Router([None] * 4).pick("x") == 0


def test_dead_engine_sessions_move_and_stick_to_the_new_engine():
    a = Router([None] * 2)
    assert a.pick("s") == 0
    a.alive[0] = False
    assert a.pick("s") == 1
    a.alive[0] = True
    assert a.pick("s") == 1
    a.alive[0] = False
    a.alive[1] = False
    with pytest.raises(EngineFailure, match="every rollout engine is dead"):  # the engines' (engine_aborted)
        a.pick("s")


def test_session_map_is_bounded_lru():
    a = Router([None] * 2, max_sessions=2)
    a.pick("a")
    a.in_flight[0] = 1
    a.pick("b")  # -> 1
    a.pick("a")  # refresh a
    a.pick("c")  # evicts b (least recently used)
    assert list(a._sessions) == ["a", "c"]


def test_needs_an_engine():
    with pytest.raises(ValueError, match="at least one engine"):
        Router([None] * 0)
