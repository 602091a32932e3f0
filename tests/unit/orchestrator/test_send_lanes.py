"""Client responses sent from lane threads (orchestrator/send_lanes.py): in order per request, final last."""
import threading
import time

import pytest

from orchestrator.send_lanes import SendLanes


class Sender:
    """Records what was sent; each send takes a while (a round trip) and may fail."""

    def __init__(self, log, name, fail_on=None):
        self.log, self.name, self.fail_on = log, name, fail_on

    def send(self, response=None, flags=0):
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
            lanes.send(lane, sender, i, 1 if i == 19 else 0)
    lanes.close()
    for k in senders:
        mine = [(r, f, t) for name, r, f, t in log if name == k]
        assert [r for r, _, _ in mine] == list(range(20)) and mine[-1][1] == 1
        assert len({t for _, _, t in mine}) == 1  # one lane
    assert len({t for *_, t in log}) == 3  # all lanes used


def test_a_failed_send_does_not_stop_the_lane():
    log = []
    lanes = SendLanes(1)
    lane = lanes.lane()
    sender = Sender(log, "a", fail_on="bad")
    for response in ("one", "bad", "two"):
        lanes.send(lane, sender, response)
    lanes.close()
    assert [r for _, r, _, _ in log] == ["one", "two"]


def test_at_least_one_lane():
    with pytest.raises(ValueError, match="lanes"):
        SendLanes(0)
