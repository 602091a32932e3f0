"""encode_prefill's step streams (``backends/stages/step_streams.py``) on the CPU: off is a no-op that makes no CUDA
call, values that cannot work are refused at load with the reason, and with stand-in streams a step on another
stream than the last waits for that one first (tests/gpu/test_step_streams.py runs the real green context)."""
import re
from contextlib import contextmanager

import pytest
import torch

from backends.runtime.loader import ModelSpec
from backends.stages import step_streams
from backends.stages.encode_prefill_worker import EncodePrefillWorker
from backends.stages.step_streams import StepStreams

CPU = torch.device("cpu")


def test_off_is_a_no_op_without_cuda_calls(monkeypatch):
    for name in ("current_stream", "stream", "get_device_properties"):
        monkeypatch.setattr(step_streams.torch.cuda, name, lambda *a, **k: pytest.fail("a CUDA call"))
    streams = StepStreams(CPU)
    for running in (True, False, True):
        with streams.for_step(running):
            pass
    assert streams.green is None
    assert streams.step_sms(True) is None and streams.step_sms(False) is None  # every step on the whole GPU


@pytest.mark.parametrize("sms, message", [
    (8, "sms_while_decoding 8 needs a CUDA device (a green context of that many SMs), got cpu; 0 turns it off"),
    (-1, "sms_while_decoding must be 0 (off) or a number of SMs, got -1")])
def test_values_that_cannot_work_are_refused_with_the_reason(sms, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StepStreams(CPU, sms)


def test_the_worker_refuses_it_on_the_cpu_before_the_model_loads(monkeypatch):
    monkeypatch.setattr("backends.stages.encode_prefill_worker.load_model", lambda spec: pytest.fail("loaded"))
    with pytest.raises(ValueError, match="sms_while_decoding 8 needs a CUDA device"):
        EncodePrefillWorker(ModelSpec(), CPU, sms_while_decoding=8)


class FakeStream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.append(f"{self.name} waits for {other.name}")


def test_a_step_on_the_other_stream_first_waits_for_the_last_one(monkeypatch):
    log: list[str] = []
    ordinary = FakeStream("ordinary", log)
    current = [ordinary]

    @contextmanager
    def stream(s):
        current.append(s)
        yield
        current.pop()

    monkeypatch.setattr(step_streams.torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(step_streams.torch.cuda, "stream", stream)
    streams = StepStreams(CPU)
    streams.green, streams.sms = FakeStream("green", log), 120  # as a green context of 120 SMs would be
    assert (streams.step_sms(True), streams.step_sms(False)) == (120, None)  # the SMs attention is sized to
    for running in (False, True, True, False, False, True):
        with streams.for_step(running):
            log.append(f"step on {current[-1].name}")
    assert log == ["step on ordinary",
                   "green waits for ordinary", "step on green", "step on green",
                   "ordinary waits for green", "step on ordinary", "step on ordinary",
                   "green waits for ordinary", "step on green"]
    assert current == [ordinary]
