"""Structured outputs' masks (backends/runtime/sampling/grammar.py) on the tiny model's tokenizer: a masked row
keeps exactly the tokens its matcher allows, a row without a matcher is untouched, greedy decoding under the mask
makes a JSON object that fits its schema and ends with an eos token."""
import json

import pytest
import torch

from backends.ipc.protocol import NO_MATCH, StructuredOutput
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.sampling.grammar import Grammars, accepted, check
from backends.runtime.tokenizer import eos_token_ids


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model(ModelSpec())
    return model, tokenizer, Grammars(tokenizer, model.lm_head.out_features, eos_token_ids(tokenizer))


def test_a_masked_row_keeps_the_tokens_its_matcher_allows(tiny):
    _, tokenizer, grammars = tiny
    matcher = grammars.matcher(StructuredOutput("regex", "[ab]c"))
    logits = torch.randn(2, grammars.vocab_size)
    plain = logits[1].clone()
    grammars.mask(logits, [matcher, None])
    allowed = {tokenizer.convert_ids_to_tokens(i) for i in torch.nonzero(logits[0] > -torch.inf).flatten().tolist()}
    assert allowed == {"a", "b"} and torch.equal(logits[1], plain)


def test_greedy_decoding_under_the_mask_makes_json_that_fits_the_schema(tiny):
    model, tokenizer, grammars = tiny
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}},
              "required": ["answer", "n"], "additionalProperties": False}
    matcher = grammars.matcher(StructuredOutput("json", json.dumps(schema), any_whitespace=False))
    ids, out, reason = tokenizer.encode("Answer:"), [], ""
    while not reason and len(out) < 60:
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[:, -1].float()
        out.append(int(grammars.mask(logits, [matcher]).argmax()))
        reason = accepted(matcher, out[-1])
    assert reason == "stop" and out[-1] in eos_token_ids(tokenizer)
    reply = json.loads(tokenizer.decode(out[:-1]))
    assert set(reply) == {"answer", "n"} and reply["answer"] in ("yes", "no") and isinstance(reply["n"], int)


def test_a_token_the_grammar_does_not_allow_is_no_match(tiny):
    _, tokenizer, grammars = tiny
    matcher = grammars.matcher(StructuredOutput("regex", "a+"))
    assert accepted(matcher, tokenizer.convert_tokens_to_ids("a")) == ""
    assert accepted(matcher, tokenizer.convert_tokens_to_ids("b")) == NO_MATCH


def test_check_names_the_problem_without_the_cpp_location_and_refuses_an_empty_language():
    with pytest.raises(ValueError, match='^Unsupported type "nope"$'):
        check(StructuredOutput("json", '{"type": "nope"}'))
    with pytest.raises(ValueError, match="^no output can match it$"):
        check(StructuredOutput("grammar", "root ::= root"))
    check(StructuredOutput("grammar", 'root ::= ""'))  # the empty output: eos at once


def test_json_object_is_an_object_as_openai_means_it(tiny):
    _, tokenizer, grammars = tiny
    for text, whole in (("[1]", False), ('{"a": [1]}', True)):
        matcher = grammars.matcher(StructuredOutput("json_object"))
        ok = all(matcher.accept_token(t) for t in tokenizer.encode(text))
        assert (ok and matcher.is_completed()) == whole, text
