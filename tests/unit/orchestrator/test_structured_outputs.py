"""The ``structured_outputs`` sampling parameter (orchestrator/structured_outputs.py): vLLM's shape taken, every
problem refused naming it (xgrammar's own word on schemas, regexes and grammars, without its C++ location)."""
import json

import pytest

from backends.ipc.protocol import StructuredOutput
from orchestrator.sampling_params import InvalidInput, parse_sampling_parameters
from orchestrator.structured_outputs import MAX_CHARS


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):  # each array one level: its items
        schema = {"type": "array", "items": schema}
    return schema


def _parsed(value) -> StructuredOutput | None:
    return parse_sampling_parameters(json.dumps({"structured_outputs": value})).structured_outputs


@pytest.mark.parametrize("value, expected", [
    ({"json": {"type": "object"}}, StructuredOutput("json", '{"type": "object"}')),
    ({"json": '{"type": "integer"}', "disable_any_whitespace": True},
     StructuredOutput("json", '{"type": "integer"}', any_whitespace=False)),
    ({"json_object": True, "regex": None, "choice": None}, StructuredOutput("json_object")),
    ({"regex": "[0-9]{3}"}, StructuredOutput("regex", "[0-9]{3}")),
    ({"choice": ["yes", 'say "no"', "naïve\n"]},
     StructuredOutput("grammar", 'root ::= "yes" | "say \\"no\\"" | "naïve\\n"')),
    ({"grammar": 'root ::= "a" | "b"'}, StructuredOutput("grammar", 'root ::= "a" | "b"')),
    (None, None),
    ('{"regex": "a+", "backend": "xgrammar"}', StructuredOutput("regex", "a+")),  # the Triton vLLM backend's string
])
def test_each_kind_is_taken(value, expected):
    assert _parsed(value) == expected


def test_guided_decoding_is_its_older_name():
    params = parse_sampling_parameters(json.dumps({"guided_decoding": {"choice": ["a", "b"]}}))
    assert params.structured_outputs == StructuredOutput("grammar", 'root ::= "a" | "b"')
    with pytest.raises(InvalidInput, match="structured_outputs .* and guided_decoding .* are one setting"):
        parse_sampling_parameters(json.dumps({"guided_decoding": {"regex": "a"}, "structured_outputs": {"regex": "b"}}))
    with pytest.raises(InvalidInput, match="^sampling_parameters: guided_decoding.regex: Regex parsing error"):
        parse_sampling_parameters(json.dumps({"guided_decoding": {"regex": "(a"}}))


@pytest.mark.parametrize("value, words", [
    ("json", "structured_outputs: a string must hold a JSON object, got 'json'"),
    ("[" * 30000, "structured_outputs: a string must hold a JSON object, got '\\[\\[\\["),  # json's RecursionError
    ("[1]", "structured_outputs must be an object holding one of json, json_object, regex, choice, grammar, got list"),
    ({"regex": "a", "backend": "outlines"}, "structured_outputs.backend: this server holds structured outputs with "
                                            "xgrammar, got 'outlines'"),
    ({}, "structured_outputs must hold exactly one of json, json_object, regex, choice, grammar, got none"),
    ({"json": {}, "regex": "a"}, "structured_outputs must hold exactly one of .*, got \\['json', 'regex'\\]"),
    ({"jsn": {}}, "structured_outputs: unknown key 'jsn'"),
    ({"json_object": 1}, "structured_outputs.json_object must be true, got 1"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string, got ''"),
    ({"json": 5}, "structured_outputs.json must be a non-empty string or an object, got 5"),
    ({"choice": ["a", ""]}, "structured_outputs.choice must be a list of 1 to 1024 non-empty strings"),
    ({"regex": "a", "disable_any_whitespace": "yes"},
     "structured_outputs.disable_any_whitespace must be a boolean, got 'yes'"),
    ({"json": {"type": "nonsense"}}, 'structured_outputs.json: Unsupported type "nonsense"$'),
    ({"json": "{not json"}, "structured_outputs.json: not JSON \\(Expecting property name"),
    ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json: the root: 'uniqueItems' is not held "
                                                       "by this server \\(xgrammar would let an output break it\\)"),
    ({"json": {"properties": {"a": {"type": "string", "maxLength": 2}}}},
     "structured_outputs.json: properties.a: 'maxLength' is not held"),
    ({"json": {"type": ["string"], "format": "colour"}}, "structured_outputs.json: the root: format 'colour' is not"),
    ({"json": {"$defs": {"x": {"contains": {}}}}}, "structured_outputs.json: \\$defs.x: 'contains'"),
    ({"json": {"anyOf": [{"not": {}}]}}, "structured_outputs.json: anyOf\\[0\\]: 'not' is not held"),
    ({"json": {"type": "number", "multipleOf": 0.5}}, "structured_outputs.json: the root: multipleOf 0.5: only an"),
    ({"json": {"$ref": "http://x/s.json"}}, "structured_outputs.json: the root: \\$ref 'http://x/s.json': only"),
    ({"json": {"type": "string", "pattern": "(?!a)"}},
     "structured_outputs.json: the root: pattern '\\(\\?!a\\)': Regex"),
    ({"json": {"type": "object", "additionalProperties": False, "required": ["a"]}},
     "structured_outputs.json: the root: required 'a' is not a property additionalProperties false allows"),
    ('{"json": "{\\"minimum\\": 1e400}"}', "structured_outputs.json: not JSON \\(the number 1e400 is beyond"),
    ({"json": _nested(33)}, "structured_outputs.json: nested more than 32 deep"),
    ({"grammar": "root ::= root"}, "structured_outputs.grammar: no output can match it"),
    ({"regex": "(a"}, "structured_outputs.regex: Regex parsing error at position 3: The parenthesis is not closed"),
    ({"grammar": "root ::= rule"}, 'structured_outputs.grammar: EBNF parser error .* Rule "rule" is not defined'),
    ({"regex": "a" * (MAX_CHARS + 1)}, f"structured_outputs.regex is {MAX_CHARS + 1} characters long, at most"),
])
def test_problems_are_refused_naming_them(value, words):
    with pytest.raises(InvalidInput, match=f"^sampling_parameters: {words}") as info:
        _parsed(value)
    assert ".cc:" not in str(info.value)


def test_names_of_properties_and_data_are_not_keywords():
    schema = {"type": "object", "properties": {"contains": {"type": "string", "default": {"uniqueItems": 1}}},
              "enum": [{"contains": 1}], "required": ["contains"]}
    assert _parsed({"json": schema}).kind == "json" and _parsed({"json": _nested(30)}).kind == "json"
    held = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3},
                                             "s": {"type": "string", "pattern": "^[a-z]+$", "format": "email"},
                                             "u": {"oneOf": [{"type": "integer"}, {"type": "string"}]}},
            "additionalProperties": False, "required": ["n"]}
    assert _parsed({"json": held}).kind == "json"


def test_min_tokens_is_refused_beside_a_structured_output():
    with pytest.raises(InvalidInput, match="min_tokens must be 0 with structured_outputs, got 2"):
        parse_sampling_parameters(json.dumps({"structured_outputs": {"regex": "a+"}, "min_tokens": 2}))


def test_a_request_with_a_structured_output_is_parsed_off_the_event_loop():
    from orchestrator.inputs import RawRequest, builds_a_grammar

    assert builds_a_grammar(RawRequest(text_input=[], sampling_parameters=[b'{"structured_outputs": {"regex": "a"}}']))
    assert builds_a_grammar(RawRequest(text_input=[], sampling_parameters=[b'{"guided_decoding": {"regex": "a"}}']))
    assert not builds_a_grammar(RawRequest(text_input=[], sampling_parameters=[b'{"max_tokens": 4}']))


def test_two_names_of_one_setting_show_their_rules_short():
    with pytest.raises(InvalidInput, match=r"structured_outputs \{regex: 'b'\} and guided_decoding \{regex: 'a'\}"):
        parse_sampling_parameters(json.dumps({"guided_decoding": {"regex": "a"}, "structured_outputs": {"regex": "b"}}))
