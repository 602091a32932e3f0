"""The safety rule of KV pages granted as replies grow (orchestrator/kv_growth.py), against a brute force over every
order in which the sequences could finish."""
import itertools
import random

import pytest

from orchestrator.kv_growth import Need, SafeState, plan, safe


def can_all_finish(free: int, needs: list[Need]) -> bool:
    """Some order lets each sequence be granted its ``remaining`` and then return it with its ``releases``."""
    for order in itertools.permutations(needs):
        pages = free
        for remaining, releases in order:
            if remaining > pages:
                break
            pages += releases
        else:
            return True
    return not needs


def random_state(rng: random.Random) -> tuple[int, dict[str, Need]]:
    while True:
        needs = {f"s{i}": Need(rng.randint(0, 12), rng.randint(0, 6)) for i in range(rng.randint(1, 5))}
        free = rng.randint(0, 15)
        if can_all_finish(free, list(needs.values())):
            return free, needs


def test_safe_is_the_brute_force():
    rng = random.Random(0)
    for _ in range(3000):
        needs = [Need(rng.randint(0, 12), rng.randint(0, 6)) for _ in range(rng.randint(0, 5))]
        free = rng.randint(0, 15)
        assert safe(free, needs) == can_all_finish(free, needs), (free, needs)


def test_two_sequences_that_cannot_both_grow_take_turns():
    """Neither may be granted a page that would leave the other unable to finish, yet the one nearer its end is."""
    needs = {"a": Need(4, 1), "b": Need(5, 1)}
    assert plan(5, needs, {"a": 1, "b": 1}) == {"a": 1, "b": 1}  # 3 left: a finishes, then b with a's 2 back
    assert plan(4, needs, {"a": 1, "b": 1}) == {"a": 1}  # both: 2 left, neither could finish
    assert plan(4, needs, {"b": 1}) == {}  # b's alone: 3 left for a's 4 and b's 4
    assert plan(6, needs, {"b": 3}) == {"b": 2}  # what is safe of what it wants: 2 pages of 3


def test_an_unsafe_state_is_never_granted_more_than_the_free_pages():
    """A removed sequence's pages may be out of the count a moment (the step in flight writes them): whatever the
    state, a plan grants at most the free pages."""
    assert plan(0, {"b": Need(1, 3)}, {"b": 1}) == {}
    assert plan(2, {"b": Need(5, 3), "c": Need(9, 0)}, {"b": 5, "c": 9}) == {"b": 2}


def test_plan_keeps_the_pool_safe_and_always_lets_the_first_of_the_safe_order_go_on():
    """Grants of 1 page up to what was wanted; the first of the safe order gets all it wants."""
    rng = random.Random(1)
    for _ in range(3000):
        free, needs = random_state(rng)
        wants = {key: rng.randint(1, need.remaining) for key, need in needs.items()
                 if need.remaining and rng.random() < 0.7}
        granted = plan(free, needs, wants)
        assert all(1 <= granted[key] <= wants[key] for key in granted)
        after = {key: Need(n.remaining - granted.get(key, 0), n.releases + granted.get(key, 0))
                 for key, n in needs.items()}
        assert can_all_finish(free - sum(granted.values()), list(after.values())), (free, needs, wants, granted)
        first = min(needs, key=lambda key: needs[key])
        if first in wants:
            assert granted.get(first) == wants[first], "the sequence first in the safe order was refused"


def test_plan_refuses_wants_beyond_the_worst_case():
    with pytest.raises(ValueError, match="wants 3 pages, may still be granted 2"):
        plan(10, {"a": Need(2, 0)}, {"a": 3})
    with pytest.raises(ValueError, match="not admitted"):
        plan(10, {"a": Need(2, 0)}, {"b": 1})


def test_the_safe_state_admits_exactly_what_keeps_the_pool_safe():
    """Each admission is checked at its own place in the order: it admits a sequence exactly when the state with it
    is safe (the brute force), one after another."""
    rng = random.Random(2)
    for _ in range(3000):
        free, needs = random_state(rng)
        state = SafeState(free, needs.values())
        added = []
        for _ in range(3):
            take, need = rng.randint(0, 8), Need(rng.randint(0, 10), rng.randint(0, 4))
            fits = take <= free and can_all_finish(free - take, [*needs.values(), *added, need])
            assert state.admits(take, need) == fits, (free, needs, added, take, need)
            if fits:
                state.admit(take, need)
                added.append(need)
                free -= take


def test_a_short_request_goes_ahead_of_a_long_reply_it_would_wait_for_if_put_last():
    """A long reply holding 8 of 64 pages may still need 55; a short request taking 2 pages, needing none after and
    returning them, is safe first in the order (a fresh user's case: it waited for the whole long reply)."""
    state = SafeState(56, [Need(55, 8)])
    assert state.admits(2, Need(0, 2))
    assert not state.admits(2, Need(0, 0))  # returning nothing, it would leave the long reply 54 of its 55
