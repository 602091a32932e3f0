"""Structured outputs through a real tritonserver: vLLM's ``structured_outputs`` in ``sampling_parameters`` (KServe)
and OpenAI's ``response_format`` (the API process). The greedy tokens equal transformers' model decoded with the
same grammar's mask (xgrammar), first token (encode_prefill) and the rest (decode) alike; the output ends with the
eos token that ends the match; a plain request beside one is unchanged; a bad schema is refused naming it."""
from __future__ import annotations

import concurrent.futures
import json

import openai
import pytest
import torch

from backends.ipc.protocol import StructuredOutput
from backends.runtime.sampling.grammar import Grammars, accepted
from backends.runtime.tokenizer import eos_token_ids
from client.api import Client, ServerError
from tests.e2e.test_openai_api import MODEL, api, hf, sdk  # noqa: F401 - the module's API process, model, SDK

pytestmark = pytest.mark.e2e
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "count": {"type": "integer"}},
          "required": ["answer", "count"], "additionalProperties": False}


def _masked_greedy(hf, prompt_ids: list[int], spec: StructuredOutput, limit: int) -> list[int]:
    """transformers' model decoded greedily under ``spec``'s mask until its match ends (or ``limit`` tokens)."""
    model, tokenizer = hf
    grammars = Grammars(tokenizer, model.lm_head.out_features, eos_token_ids(tokenizer))
    matcher, out, reason = grammars.matcher(spec), [], ""
    while not reason and len(out) < limit:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + out], device=model.device)).logits[:, -1].float()
        out.append(int(grammars.mask(logits, [matcher]).argmax()))
        reason = accepted(matcher, out[-1])
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_completion_held_to_a_regex_is_transformers_under_the_same_mask(sdk, hf, stream):
    prompt = "The code is"
    spec = StructuredOutput("regex", "[0-9]{3}-[a-f]{2}")
    reference = _masked_greedy(hf, hf[1].encode(prompt), spec, 20)
    reply = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=stream,
                                   extra_body={"return_token_ids": True, "ignore_eos": True,
                                               "structured_outputs": {"regex": spec.text}})
    chunks = list(reply) if stream else [reply]
    ids = [i for c in chunks for choice in c.choices for i in choice.token_ids]
    reasons = [choice.finish_reason for c in chunks for choice in c.choices if choice.finish_reason]
    text = "".join(choice.text for c in chunks for choice in c.choices)
    assert ids == reference and reasons == ["stop"]  # ended by the match's eos, ignore_eos or not
    assert len(text) == 6 and text[3] == "-" and text[:3].isdigit()


def test_a_chat_with_a_json_schema_and_a_plain_chat_beside_it(sdk, hf):
    """Both at once (in one decode batch): the held one's reply is JSON that fits the schema, and the plain one's
    tokens are those it has alone."""
    plain = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about rivers."}], "max_tokens": 12,
             "temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    held = {"model": MODEL, "messages": [{"role": "user", "content": "Yes or no, and how many?"}], "max_tokens": 60,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}}
    alone = sdk.chat.completions.create(**plain).choices[0].token_ids
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = pool.submit(sdk.chat.completions.create, **plain)
        reply = pool.submit(sdk.chat.completions.create, **held).result().choices[0]
        assert together.result().choices[0].token_ids == alone
    assert reply.finish_reason == "stop", reply
    data = json.loads(reply.message.content)
    assert set(data) == {"answer", "count"} and data["answer"] in ("yes", "no") and isinstance(data["count"], int)


def test_kserve_structured_outputs_choice_and_a_bad_schema(grpc_url):
    with Client(grpc_url) as client:
        for seed in range(3):
            result = client.generate("Pick one.", sampling={"structured_outputs": {"choice": ["red", "green"]},
                                                            "max_tokens": 10, "temperature": 1.0, "seed": seed})
            assert result.text in ("red", "green") and result.finish_reason == "stop"
        with pytest.raises(ServerError, match='sampling_parameters: structured_outputs.json: Unsupported type "x"'):
            client.generate("Hi", sampling={"structured_outputs": {"json": {"type": "x"}}})


def test_a_grammar_of_the_empty_output_ends_at_its_first_token_beside_a_stream(grpc_url):
    """Its mask allows eos alone: the request ends there ("stop", ignore_eos or not) and a stream decoding beside it
    (in the same decode batch were it admitted) goes on to its length."""
    with Client(grpc_url) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        plain = pool.submit(client.generate, "Tell me a story.", sampling={"max_tokens": 40, "ignore_eos": True})
        empty = client.generate("Say nothing.", sampling={"structured_outputs": {"grammar": 'root ::= ""'},
                                                         "ignore_eos": True, "max_tokens": 16}, return_output_ids=True)
        assert (empty.text, empty.finish_reason, len(empty.token_ids)) == ("", "stop", 1)
        assert plain.result().finish_reason == "length"


@pytest.mark.parametrize("rule", [{"regex": "a[^\\s\\S]"}, {"grammar": 'root ::= "a" b\nb ::= b "c"'}],
                         ids=["regex", "grammar"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_grammar_that_dead_ends_after_its_first_token_is_the_clients_error(sdk, rule, stream):
    """Its first character is possible, nothing after it: a 400 naming structured_outputs (streamed: the error
    event after the first chunk), not a server error; the next request is served."""
    request = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=20, stream=stream,
                   extra_body={"structured_outputs": rule})
    with pytest.raises(openai.APIError) as error:
        reply = sdk.chat.completions.create(**request)
        list(reply) if stream else reply
    assert "structured_outputs: no output can match it" in str(error.value)
    if not stream:
        assert error.value.status_code == 400 and error.value.body["param"] == "structured_outputs"
    assert sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2).choices[0].finish_reason in ("length", "stop")


def test_a_bad_response_format_is_400_naming_it(sdk):
    with pytest.raises(openai.BadRequestError) as error:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "r", "schema": {"type": "x"}}})
    assert error.value.body["param"] == "response_format"
    assert error.value.body["message"] == 'response_format.json_schema.schema: Unsupported type "x"'
