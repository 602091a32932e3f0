"""The fair queue of flashcodec's decode threads: a lone key uses every slot, a freed slot goes to the waiting key
with the fewest running (round robin on ties), one key's items keep their order, drops and errors leave the
slot count right."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from flashcodec.fair_queue import FairQueue


def take_all(queue: FairQueue) -> list:
    taken = []
    while (got := queue.take()) is not None:
        taken.append(got)
    return taken


def test_a_lone_key_uses_every_slot_in_order():
    queue = FairQueue(4)
    for i in range(6):
        queue.put("a", i)
    assert take_all(queue) == [("a", 0), ("a", 1), ("a", 2), ("a", 3)]
    assert queue.busy == 4 and len(queue) == 2
    queue.done("a")
    assert take_all(queue) == [("a", 4)]


def test_a_newcomer_takes_the_first_free_slot_then_the_busy_key_stops_growing():
    queue = FairQueue(4)
    for i in range(8):
        queue.put("big", i)
    assert len(take_all(queue)) == 4
    queue.put("small", "s")
    assert queue.take() is None  # every slot busy: running items are never interrupted
    queue.done("big")
    assert queue.take() == ("small", "s")  # ahead of the 4 big items queued before it
    queue.put("small", "t")
    queue.done("big")  # big 2 running, small 1: the slot goes to small
    assert queue.take() == ("small", "t")
    queue.done("big")  # big 1, small 2
    assert queue.take() == ("big", 4)


def test_equal_keys_take_turns():
    queue = FairQueue(1)
    for key in "abc":
        for i in range(3):
            queue.put(key, i)
    order = []
    while (got := queue.take()) is not None:
        order.append(got)
        queue.done(got[0])
    assert order == [(k, i) for i in range(3) for k in "abc"]


def test_a_key_that_has_just_queued_goes_before_one_already_served():
    queue = FairQueue(1)
    queue.put("a", 0)
    assert queue.take() == ("a", 0)
    for i in range(1, 3):  # a's queue was empty, but a ran: it has been served
        queue.put("a", i)
    queue.put("b", 0)
    queue.done("a")
    assert queue.take() == ("b", 0)  # a and b run none: a was served, b not since it queued


def test_two_busy_keys_share_the_slots_evenly_as_items_end():
    queue = FairQueue(4)
    for i in range(20):
        queue.put("a", i)
    running = [key for key, _ in take_all(queue)]
    for i in range(20):
        queue.put("b", i)
    for _ in range(8):
        queue.done(running.pop(0))
        running += [key for key, _ in take_all(queue)]
    assert Counter(running) == {"a": 2, "b": 2}


def test_drop_removes_queued_items_only_and_drain_removes_all():
    queue = FairQueue(2)
    for i in range(4):
        queue.put("a", i)
        queue.put("b", i)
    assert take_all(queue) == [("a", 0), ("b", 0)]
    assert queue.drop("a") == [1, 2, 3] and queue.drop("a") == [] and queue.drop("nobody") == []
    assert queue.busy == 2  # a's running item still holds its slot until it ends
    queue.done("a")
    assert queue.take() == ("b", 1)
    assert queue.drain() == [("b", 2), ("b", 3)] and len(queue) == 0 and queue.take() is None


def test_a_slot_returned_twice_is_refused():
    queue = FairQueue(2)
    queue.put("a", 0)
    queue.take()
    queue.done("a")
    with pytest.raises(ValueError, match="without a running item"):
        queue.done("a")
    with pytest.raises(ValueError, match="slots must be >= 1"):
        FairQueue(0)


@pytest.mark.parametrize("seed", range(20))
def test_random_schedules_keep_every_rule(seed):
    """Random puts, takes, ends and drops on 1-5 slots and 1-6 keys: never more running than slots, no slot idle
    while items wait, each take goes to a waiting key with the fewest running (on ties, to one not served since
    it last had nothing queued or running, if any), and each key's items start in the order they were put."""
    rng = random.Random(seed)
    slots = rng.randint(1, 5)
    keys = [f"r{k}" for k in range(rng.randint(1, 6))]
    queue: FairQueue[str, int] = FairQueue(slots)
    queued = {k: [] for k in keys}  # the model: each key's items not yet taken, in order
    running = Counter()
    served = set()  # keys served since they last had nothing queued or running
    serial = 0
    for _ in range(400):
        action = rng.random()
        if action < 0.45:
            key = rng.choice(keys)
            queue.put(key, serial)
            queued[key].append(serial)
            serial += 1
        elif action < 0.85 and +running:
            key = rng.choice(sorted((+running).elements()))
            queue.done(key)
            running[key] -= 1
            if not running[key] and not queued[key]:
                served.discard(key)
        elif action < 0.9:
            key = rng.choice(keys)
            assert queue.drop(key) == queued[key]
            queued[key] = []
            if not running[key]:
                served.discard(key)
        while True:
            waiting = [k for k in keys if queued[k]]
            got = queue.take()
            if got is None:
                assert sum(running.values()) == slots or not waiting  # no slot idles while items wait
                break
            key, item = got
            assert running[key] == min(running[k] for k in waiting)
            unserved = [k for k in waiting if running[k] == running[key] and k not in served]
            assert key in unserved or not unserved  # ties: a key that had nothing queued or running first
            served.add(key)
            assert item == queued[key].pop(0)
            running[key] += 1
            assert queue.busy == sum(running.values()) <= slots
    assert len(queue) == sum(len(v) for v in queued.values())
    queue.drain()
    for key in (+running).elements():
        queue.done(key)
    assert queue.busy == 0 and not queue._turn and not queue._running  # nothing kept of keys that have gone
