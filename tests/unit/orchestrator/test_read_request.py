"""A Triton request's inputs as the orchestrator reads them (orchestrator.frontend.read_request over
backends.triton.triton_io.input_arrays): one pass over ``request.inputs()``, absent inputs at their defaults."""
from __future__ import annotations

import dataclasses

import numpy as np

from orchestrator.frontend import _given, read_request
from orchestrator.inputs import RawRequest
from tests.unit.orchestrator.fake_responses import Tensor


class FakeRequest:
    """The stub's InferenceRequest as read_request uses it; counts the calls of ``inputs()``."""

    def __init__(self, **inputs: np.ndarray):
        self._tensors = [Tensor(name, array) for name, array in inputs.items()]
        self.calls = 0

    def inputs(self) -> list[Tensor]:
        self.calls += 1
        return list(self._tensors)

    def parameters(self) -> str:
        return "{}"


def test_inputs_are_read_in_one_pass_with_absent_ones_at_their_defaults():
    request = FakeRequest(messages=np.array([b'[{"role": "user"}]'], dtype=np.object_),
                          image_url=np.array([b"file:///a.jpg", "file:///b.jpg"], dtype=np.object_),
                          stream=np.array([True]), return_output_ids=np.array([], dtype=bool))
    raw = read_request(request)
    assert request.calls == 1
    assert raw.messages == [b'[{"role": "user"}]'] and raw.image_url == [b"file:///a.jpg", b"file:///b.jpg"]
    assert raw.text_input == [] and raw.video == [] and raw.sampling_parameters == []
    assert raw.stream is True and raw.exclude_input_in_output is False
    assert raw.return_output_ids is False  # an empty BOOL input: its default


def test_an_input_is_given_when_it_is_not_at_its_default():
    """A channel's opening carries no other input (``frontend._serve_channel``): an input counts as given when its
    value is not its field's default, so ``return_input_tokens`` (default true) counts only when sent false."""
    fields = {f.name: f for f in dataclasses.fields(RawRequest)}

    def given(**inputs: np.ndarray) -> list[str]:
        raw = read_request(FakeRequest(open_token_channel=np.array([b"c"], dtype=np.object_), **inputs))
        return [name for name, f in fields.items() if name != "open_token_channel" and _given(raw, f)]
    assert given() == []
    assert given(return_input_tokens=np.array([True])) == []
    assert given(return_input_tokens=np.array([False])) == ["return_input_tokens"]
    assert given(text_input=np.array([b"x"], dtype=np.object_), stream=np.array([True])) == ["text_input", "stream"]
