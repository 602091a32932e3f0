"""The decode loop's pacing clock (``backends/stages/decode_pace.py``)."""
from pytest import approx

from backends.stages.decode_pace import Pacing


def test_launches_wait_for_the_interval_until_the_pacing_ends():
    pacing = Pacing.starting(40, 100, now=10.0)  # 40 ms apart until 10.1 s
    assert pacing.wait_s(last_launch=10.0, now=10.01) == approx(0.03)
    assert pacing.wait_s(last_launch=9.0, now=10.01) == 0.0        # the last launch is long past
    assert pacing.wait_s(last_launch=10.08, now=10.09) == approx(0.01)  # never past the pacing's end
    assert pacing.wait_s(last_launch=10.09, now=10.1) == 0.0       # over


def test_no_pacing():
    for pacing in (Pacing(), Pacing.starting(0, 100, now=1.0), Pacing.starting(40, 0, now=1.0)):
        assert pacing.wait_s(last_launch=1.0, now=1.0) == 0.0
