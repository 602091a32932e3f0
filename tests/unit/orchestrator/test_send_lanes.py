"""Client responses built and sent from lane threads (orchestrator/send_lanes.py): in order per request, final
last; a lane that fell behind merges a request's queued items into one response."""
import threading
import time
from dataclasses import dataclass

import pytest

from orchestrator.send_lanes import SendLanes, merged


@dataclass(frozen=True)
class Piece:
    """An item whose response is the list of its ``values``; merges unless it is final or ``alone``; once sent, its
    values go to ``noted`` (when given)."""

    values: tuple
    flags: int = 0
    alone: bool = False
    noted: list | None = None
    trailing: bool = False

    def merge(self, later):
        if self.flags or self.alone or later.alone:
            return None
        return Piece(self.values + later.values, later.flags, noted=later.noted)

    def build(self):
        return list(self.values)

    def sent(self):
        if self.noted is not None:
            self.noted.append(self.values)


class Sender:
    """Records what was sent; each send takes a while (a round trip), may fail, and may wait for ``go``."""

    def __init__(self, log, name, fail_on=None, go=None):
        self.log, self.name, self.fail_on, self.go = log, name, fail_on, go
        self.waiting = threading.Event()  # set once a send waits for go

    def send(self, response=None, flags=0):
        if self.go is not None:
            self.waiting.set()
            self.go.wait(5)
        time.sleep(0.001)
        if response == self.fail_on:
            raise RuntimeError("Response sender has been closed")
        self.log.append((self.name, response, flags, threading.current_thread().name))


def test_each_requests_responses_leave_in_order_on_one_lane():
    log = []
    lanes = SendLanes(3)
    senders = {k: (Sender(log, k), lanes.lane()) for k in range(6)}
    for i in range(20):
        for k, (sender, lane) in senders.items():
            lanes.send(lane, sender, Piece((i,), 1 if i == 19 else 0))
    lanes.close()
    for k in senders:
        mine = [(r, f, t) for name, r, f, t in log if name == k]
        assert [v for r, _, _ in mine for v in r] == list(range(20))  # merged or not, in order
        assert mine[-1][1] == 1 and all(f == 0 for _, f, _ in mine[:-1])  # final last
        assert len({t for _, _, t in mine}) == 1  # one lane
    assert len({t for *_, t in log}) == 3  # all lanes used


def test_a_blocked_lane_sends_one_requests_queued_items_as_one_response():
    log, go = [], threading.Event()
    lanes = SendLanes(1)
    lane = lanes.lane()
    a, b = Sender(log, "a", go=go), Sender(log, "b")
    lanes.send(lane, a, Piece((0,)))
    assert a.waiting.wait(5)  # the lane has taken it and is held in its send
    for i in range(1, 5):
        lanes.send(lane, a, Piece((i,)))
        lanes.send(lane, b, Piece((i,)))
    lanes.send(lane, a, Piece((5,), flags=1))
    go.set()
    lanes.close()
    assert [(name, r, f) for name, r, f, _ in log] == [
        ("a", [0], 0), ("a", [1, 2, 3, 4, 5], 1), ("b", [1, 2, 3, 4], 0)]


def test_merging_keeps_each_requests_order_and_what_does_not_merge():
    a, b = object(), object()
    queued = [(a, Piece((1,))), (b, Piece((1,))), (a, Piece((2,), alone=True)), (a, Piece((3,))),
              (b, Piece((2,), flags=1)), (a, Piece((4,), flags=1))]
    assert [(s, p.values, p.flags) for s, p in merged(queued)] == [
        (a, (1,), 0), (b, (1, 2), 1), (a, (2,), 0), (a, (3, 4), 1)]
    final_first = [(a, Piece((1,), flags=1)), (a, Piece((2,)))]
    assert merged(final_first) == final_first  # a final item takes nothing after it


def test_trailing_items_go_after_the_others_queued_with_them_each_senders_order_kept():
    """A timeline's reply (Reply.trailing) does not hold up tokens queued after it for other requests."""
    a, b = object(), object()
    queued = [(a, Piece((1,))), (a, Piece(("a-timeline",), flags=1, trailing=True)), (b, Piece((1,))),
              (b, Piece((2,))), (b, Piece(("b-timeline",), flags=1, trailing=True))]
    assert [(s, p.values, p.flags) for s, p in merged(queued)] == [
        (a, (1,), 0), (b, (1, 2), 0), (a, ("a-timeline",), 1), (b, ("b-timeline",), 1)]


def test_a_trailing_item_waits_while_more_items_come():
    """A step's tokens reach a lane one request at a time: a timeline queued behind one request's tokens is sent
    once no other request's tokens are queued."""
    log, go_a, go_b = [], threading.Event(), threading.Event()
    lanes = SendLanes(1)
    lane = lanes.lane()
    a, b, c = Sender(log, "a", go=go_a), Sender(log, "b", go=go_b), Sender(log, "c")
    lanes.send(lane, a, Piece((1,)))
    assert a.waiting.wait(5)
    lanes.send(lane, a, Piece(("a-timeline",), flags=1, trailing=True))
    lanes.send(lane, b, Piece((1,)))
    go_a.set()
    assert b.waiting.wait(5)  # the lane sends b's token; c's comes meanwhile
    lanes.send(lane, c, Piece((1,)))
    go_b.set()
    lanes.close()
    assert [(name, r) for name, r, _, _ in log] == [("a", [1]), ("b", [1]), ("c", [1]), ("a", ["a-timeline"])]


def test_a_trailing_item_waits_one_round_at_most_on_a_busy_lane():
    """Items arriving faster than the lane sends them keep its queue from ever being empty: a timeline still goes
    out after the items queued while the tokens before it were sent, not after all that come later. Each round's
    items are queued while the lane is held in the first send of the round before (no timing: a lane that fell
    behind would otherwise take more items in its first round, and the timeline's place would move with them)."""
    log, go = [], threading.Event()
    lanes = SendLanes(1)
    lane = lanes.lane()
    a = Sender(log, "a", go=go)
    lanes.send(lane, a, Piece((1,)))
    assert a.waiting.wait(5)  # the lane is in a's first send
    lanes.send(lane, a, Piece(("a-timeline",), flags=1, trailing=True))
    rounds = [[Sender(log, f"b{r}.{k}", go=threading.Event() if k == 0 else None) for k in range(5)]
              for r in range(3)]  # other requests' tokens
    held = a
    for senders in rounds:
        for k, sender in enumerate(senders):
            lanes.send(lane, sender, Piece((k,)))
        held.go.set()
        held = senders[0]
        assert held.waiting.wait(5)  # the lane sends this round's first item; the next round's come meanwhile
    held.go.set()
    lanes.close()
    names = [name for name, *_ in log]
    assert [r for name, r, _, _ in log if name == "a"] == [[1], ["a-timeline"]]
    # after the items queued with it (round 0) and those queued while they were sent (round 1), before round 2
    # (without the one-round rule: after all of them)
    assert names == ["a", *(s.name for s in rounds[0] + rounds[1]), "a", *(s.name for s in rounds[2])], names


def test_a_failed_send_does_not_stop_the_lane_and_only_what_was_handed_over_is_noted_as_sent():
    log, noted = [], []
    lanes = SendLanes(1)
    lane = lanes.lane()
    sender = Sender(log, "a", fail_on=["bad"])
    for value in ("one", "bad", "two"):
        lanes.send(lane, sender, Piece((value,), alone=True, noted=noted))
    lanes.close()
    assert [r for _, r, _, _ in log] == [["one"], ["two"]]
    assert noted == [("one",), ("two",)]  # Item.sent: after the send, not for the one that failed


def test_at_least_one_lane():
    with pytest.raises(ValueError, match="lanes"):
        SendLanes(0)
