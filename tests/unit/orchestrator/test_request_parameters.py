"""A request's Triton parameters as its sampling parameters (orchestrator/request_parameters.py), as the vLLM
backend reads them where the ``sampling_parameters`` input is absent."""
from __future__ import annotations

import json

import pytest

from orchestrator.inputs import InputLimits, RawRequest, builds_a_grammar, parse_request
from orchestrator.request_parameters import sampling_text
from orchestrator.sampling_params import InvalidInput


def test_the_sampling_keys_are_kept_and_stream_and_tritons_own_left_out():
    assert sampling_text("{}") is None and sampling_text("") is None
    assert sampling_text('{"stream": true, "triton_enable_empty_final_response": true}') is None
    # a generate body's id (the request id) and the keys only a model's scheduler applies
    assert sampling_text('{"id": "r1", "priority": 1, "timeout": 100, "sequence_id": 7, "sequence_start": true, '
                         '"sequence_end": false}') is None
    assert json.loads(sampling_text('{"stream": false, "max_tokens": 5, "temperature": 0.5}')) == \
        {"max_tokens": 5, "temperature": 0.5}


def test_a_request_without_sampling_parameters_samples_by_its_parameters_and_the_input_wins():
    raw = RawRequest(text_input=[b"Hi"], parameters=sampling_text('{"max_tokens": 5, "temperature": 0}'))
    params = parse_request(raw, InputLimits()).params
    assert params.max_tokens == 5 and params.temperature == 0
    both = RawRequest(text_input=[b"Hi"], parameters=raw.parameters, sampling_parameters=[b'{"max_tokens": 7}'])
    assert parse_request(both, InputLimits()).params.max_tokens == 7


@pytest.mark.parametrize("given, says", [
    ('{"foo": 1}', "parameters: unknown key 'foo' (known: "),
    ('{"max_tokens": -1}', "parameters: max_tokens "),
])
def test_a_bad_key_is_refused_naming_the_parameters(given, says):
    with pytest.raises(InvalidInput) as refused:
        parse_request(RawRequest(text_input=[b"Hi"], parameters=sampling_text(given)), InputLimits())
    assert str(refused.value).startswith(says), refused.value


def test_beside_sampling_parameters_a_parameter_that_is_no_sampling_key_is_refused():
    """Triton's generate endpoint passes a misspelled input (``video_urls``) on as a parameter: it is refused, not
    dropped; the parameters' sampling keys (even bad values of them) are not read, as the vLLM backend's."""
    def parsed(parameters: str):
        return parse_request(RawRequest(text_input=[b"Hi"], parameters=sampling_text(parameters),
                                        sampling_parameters=[b'{"max_tokens": 7}']), InputLimits())
    with pytest.raises(InvalidInput, match=r"^parameters: unknown key 'video_urls': not an input of this model "):
        parsed('{"video_urls": "/media/clip.mp4", "max_tokens": 5}')
    assert parsed('{"max_tokens": -1, "max_patches": 3, "stream": true, "id": "r1"}').params.max_tokens == 7


def test_a_structured_output_in_the_parameters_is_parsed_off_the_event_loop():
    raw = RawRequest(text_input=[b"Hi"], parameters=sampling_text('{"structured_outputs": {"regex": "a+"}}'))
    assert builds_a_grammar(raw)
