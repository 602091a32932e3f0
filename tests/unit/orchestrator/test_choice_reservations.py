"""Places held for a request's later choices (orchestrator/choice_reservations.py): taken one each, counted while
held, given back a grace after the request holding them ends; the inputs' checks."""
import pytest

from orchestrator.choice_reservations import MAX_CHOICES, ChoiceReservations, choice_of_input, choices_input
from orchestrator.sampling_params import InvalidInput


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_held_places_are_counted_and_taken_one_each():
    reservations = ChoiceReservations(clock=Clock())
    reservations.hold("a", 2)
    reservations.hold("b", 1)
    assert reservations.held() == 3
    assert reservations.take("a") and reservations.held() == 2
    assert reservations.take("a") and not reservations.take("a")  # all of a's taken
    assert not reservations.take("never-held") and reservations.held() == 1


def test_a_request_id_holds_places_once_at_a_time():
    reservations = ChoiceReservations(clock=Clock())
    reservations.hold("a", 1)
    with pytest.raises(InvalidInput, match="choices: a request with id 'a' holds places"):
        reservations.hold("a", 3)
    assert reservations.take("a")
    reservations.hold("a", 1)  # all taken: the id is free again
    assert reservations.held() == 1


def test_places_no_choice_took_are_given_back_a_grace_after_their_request_ends():
    clock = Clock()
    reservations = ChoiceReservations(grace_s=30.0, clock=clock)
    reservations.hold("a", 3)
    clock.now = 1000.0  # still running: held however long it runs
    assert reservations.held() == 3
    reservations.ended("a")
    clock.now = 1029.0
    assert reservations.take("a") and reservations.held() == 2  # a late choice still finds its place
    reservations.ended("a")  # a second end does not move the grace
    clock.now = 1030.0
    assert reservations.held() == 0 and not reservations.take("a")
    reservations.ended("gone")  # nothing held: nothing to do


def test_the_inputs_are_checked():
    assert choices_input(None) == choices_input([]) == 1 and choices_input([MAX_CHOICES]) == MAX_CHOICES
    for bad, message in (([0], r"choices: must be in \[1, 128\], got 0"), ([MAX_CHOICES + 1], "got 129"),
                         ([2, 2], "expected one value, got 2")):
        with pytest.raises(InvalidInput, match=message):
            choices_input(bad)
    assert choice_of_input([]) == "" and choice_of_input([b"abc"]) == "abc"
    for bad, message in (([b""], "1 to 256 bytes, got 0"), ([b"x" * 257], "got 257"), ([b"\xff"], "not valid UTF-8"),
                         ([b"a", b"b"], "expected one request id, got 2")):
        with pytest.raises(InvalidInput, match=message):
            choice_of_input(bad)
