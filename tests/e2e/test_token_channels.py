"""Token channels (orchestrator/token_channels.py) through a real tritonserver with tritonclient: a channel's entries
carry the same tokens as the requests' own streams would, each request's own stream ends with its finish reason
alone, errors name the input at fault, an id in flight on a channel is refused there until its request ended, a
cancelled channel closes with its final flag, and the OpenAI API streams the same with its channel as without."""
from __future__ import annotations

import concurrent.futures
import json
import queue
import time
import uuid

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from client.api import ServerError, grpc_inputs, request_tensors
from tests.e2e.conftest import wait_for_idle_pools
from tests.e2e.test_openai_api import _api
from tests.e2e.test_vllm_parity import vllm_request

pytestmark = pytest.mark.e2e
GREEDY = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
PROMPTS = {"first": "Say the same thing again and again.", "second": "Count from one to ten."}
TIMEOUT_S = 120


def _text(name: str, value: str) -> tuple[str, np.ndarray, str]:
    return name, np.array([value.encode()], dtype=np.object_), "BYTES"


def _is_final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


class Stream:
    """One gRPC stream of tritonclient's, its responses (or errors) in a queue as (request id, result, error)."""

    def __init__(self, grpc_url: str):
        self.client = grpcclient.InferenceServerClient(grpc_url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def send(self, tensors, request_id: str) -> None:
        self.client.async_stream_infer("orchestrator", grpc_inputs(tensors), request_id=request_id,
                                       enable_empty_final_response=True)

    def next(self):
        return self.responses.get(timeout=TIMEOUT_S)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def open_channel(grpc_url: str) -> tuple[str, Stream]:
    name = f"test-{uuid.uuid4().hex}"
    stream = Stream(grpc_url)
    stream.send([_text("open_token_channel", name)], request_id=name)
    result, error = stream.next()
    assert error is None, error
    assert json.loads(result.as_numpy("channel_items")[0]) == [] and not _is_final(result)
    return name, stream


def test_a_channel_carries_its_requests_tokens_and_their_own_streams_end_with_the_reason(grpc_url, server):
    name, channel = open_channel(grpc_url)
    own = Stream(grpc_url)
    try:
        for key, prompt in PROMPTS.items():
            tensors = request_tensors(prompt, sampling=GREEDY, return_output_ids=True)
            own.send(tensors + [_text("token_channel", name)], request_id=key)
        ends = {}
        while len(ends) < len(PROMPTS):  # each own stream: its finish reason alone, with the final flag
            result, error = own.next()
            assert error is None, error
            assert _is_final(result) and result.as_numpy("text_output") is None
            ends[result.get_response().id] = result.as_numpy("finish_reason")[0].decode()
        assert ends == {"first": "length", "second": "length"}
        entries: dict[str, list[dict]] = {key: [] for key in PROMPTS}
        while not all(e and e[-1].get("finish_reason") not in (None, "None") for e in entries.values()):
            result, error = channel.next()
            assert error is None, error
            for entry in json.loads(result.as_numpy("channel_items")[0]):
                entries[entry.pop("id")].append(entry)
        for key, prompt in PROMPTS.items():  # the same tokens, text and totals as the request's own stream gives
            alone = vllm_request(grpc_url, prompt, GREEDY, return_output_ids=True)
            assert [i for e in entries[key] for i in e["output_ids"]] == \
                [int(i) for r in alone for i in r.as_numpy("output_ids")]
            assert "".join(e["text_output"] for e in entries[key]) == \
                b"".join(r.as_numpy("text_output")[0] for r in alone).decode()
            last = entries[key][-1]
            assert (last["finish_reason"], last["num_output_tokens"]) == ("length", GREEDY["max_tokens"])
            assert last["num_input_tokens"] == int(alone[-1].as_numpy("num_input_tokens")[0])
    finally:
        own.close()
        channel.close(cancel=True)
    wait_for_idle_pools(server)


def _until_final(grpc_url: str, tensors, request_id: str | None = None) -> None:
    """Send ``tensors`` as one streamed request (``request_id`` or a new one) and read it to its final response;
    raises ServerError."""
    stream = Stream(grpc_url)
    try:
        stream.send(tensors, request_id=request_id or uuid.uuid4().hex)
        while True:
            result, error = stream.next()
            if error is not None:
                raise ServerError(str(error))
            if _is_final(result):
                return
    finally:
        stream.close()


def test_closing_a_channel_cancels_its_running_requests(grpc_url, server):
    """Nobody reads a closed channel's replies: its requests are cancelled, their own streams end with "abort" and
    their pages come back."""
    name, channel = open_channel(grpc_url)
    own = Stream(grpc_url)
    try:
        long = request_tensors("Tell me everything.", sampling={**GREEDY, "max_tokens": 4000})
        for key in ("x", "y"):
            own.send(long + [_text("token_channel", name)], request_id=key)
        result, error = channel.next()  # the requests are running
        assert error is None and json.loads(result.as_numpy("channel_items")[0])
        channel.client.stop_stream(cancel_requests=True)
        ends = {}
        while len(ends) < 2:
            result, error = own.next()
            assert error is None and _is_final(result), error
            ends[result.get_response().id] = result.as_numpy("finish_reason")[0].decode()
        assert ends == {"x": "abort", "y": "abort"}
    finally:
        own.close()
        channel.client.close()
    m = wait_for_idle_pools(server, timeout_s=30)
    assert m["unifiedserve_kv_pages_free"] == m["unifiedserve_kv_pages_total"]


def test_a_request_id_in_flight_on_a_channel_is_refused_until_its_request_ended(grpc_url, server):
    """A second request with the id of one running on the channel is refused, naming both; once the first was
    cancelled the id is taken again, and no page stays held."""
    name, channel = open_channel(grpc_url)
    first = Stream(grpc_url)
    long = request_tensors("Tell me everything.", sampling={**GREEDY, "max_tokens": 4000})
    short = request_tensors("Hi", sampling={**GREEDY, "max_tokens": 1})
    try:
        first.send(long + [_text("token_channel", name)], request_id="same")
        result, error = channel.next()  # it is running
        assert error is None and json.loads(result.as_numpy("channel_items")[0])
        for _ in range(2):  # a refusal leaves the first request's id taken
            with pytest.raises(ServerError, match=f"token_channel: a request with id 'same' is in flight on "
                                                  f"channel '{name}' already"):
                _until_final(grpc_url, long + [_text("token_channel", name)], request_id="same")
        first.close(cancel=True)
        for _ in range(100):  # the cancel watch asks every 50 ms
            try:
                _until_final(grpc_url, short + [_text("token_channel", name)], request_id="same")
                break
            except ServerError as exc:
                assert "is in flight on channel" in str(exc)
                time.sleep(0.05)
        else:
            pytest.fail("the cancelled request's id stayed in flight")
    finally:
        channel.close(cancel=True)
    m = wait_for_idle_pools(server, timeout_s=30)
    assert m["unifiedserve_kv_pages_free"] == m["unifiedserve_kv_pages_total"]


def test_a_cancelled_channel_closes_and_its_name_is_then_refused(grpc_url):
    name, channel = open_channel(grpc_url)
    channel.client.stop_stream(cancel_requests=True)
    channel.client.close()
    tensors = request_tensors("Hi", sampling={**GREEDY, "max_tokens": 1}) + [_text("token_channel", name)]
    for _ in range(100):  # the cancel watch asks every 50 ms
        try:
            _until_final(grpc_url, tensors)
        except ServerError as exc:
            assert "token_channel: no channel" in str(exc) and name in str(exc)
            return
    pytest.fail("the cancelled channel stayed open")


@pytest.mark.parametrize("tensors, words", [
    (lambda name: request_tensors("Hi", sampling=GREEDY) + [_text("token_channel", "no-such-channel")],
     "token_channel: no channel 'no-such-channel' is open"),
    (lambda name: [_text("open_token_channel", name)], "open_token_channel: a channel"),
    (lambda name: request_tensors("Hi") + [_text("open_token_channel", "other")],
     "open_token_channel: a request opening a channel carries no other input, got text_input"),
    (lambda name: [_text("open_token_channel", "other"), _text("token_channel", name)],
     "open_token_channel: a request opening a channel carries no other input, got token_channel"),
    (lambda name: request_tensors("Hi", stream=False) + [_text("token_channel", "no-such-channel")],
     "token_channel: no channel 'no-such-channel' is open"),
    (lambda name: [_text("open_token_channel", "")], "open_token_channel: a channel name is 1 to 256 bytes"),
])
def test_channel_errors_name_the_input(grpc_url, tensors, words):
    name, channel = open_channel(grpc_url)
    try:
        with pytest.raises(ServerError, match=words):
            _until_final(grpc_url, tensors(name))
    finally:
        channel.close(cancel=True)


def test_the_openai_api_streams_the_same_with_and_without_its_token_channel(server, tmp_path):
    """`--no-token-channel` (each request on its own stream) and the default give the same chunks' tokens, text and
    usage for concurrent streamed chats."""
    def answers(channel: bool) -> list[tuple]:
        with _api(server.ports.grpc, tmp_path / f"api_{channel}.log", token_channel=channel) as process, \
                openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
            def ask(prompt: str) -> tuple:
                chunks = list(sdk.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0,
                    stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True, "return_token_ids": True}))
                ids = [i for c in chunks if c.choices for i in (c.choices[0].model_extra.get("token_ids") or [])]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                return ids, text, reasons, chunks[-1].usage.completion_tokens
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                return list(pool.map(ask, [f"Story number {k}." for k in range(8)]))

    with_channel, without = answers(True), answers(False)
    assert with_channel == without
    assert all(len(ids) == 12 and reasons == ["length"] and used == 12 for ids, _, reasons, used in with_channel)


def _try_open(grpc_url: str, opened: list[Stream]):
    """Open a channel on a new stream, kept in ``opened`` if it opened; None, or the error that refused it."""
    name, stream = f"test-{uuid.uuid4().hex}", Stream(grpc_url)
    stream.send([_text("open_token_channel", name)], request_id=name)
    _, error = stream.next()
    if error is None:
        opened.append(stream)
    else:
        stream.close()  # its request has ended
    return error


def test_channels_beyond_max_token_channels_are_refused_until_one_closes(grpc_url):
    """The parameter ``max_token_channels`` (64 by default; some may be open already, the test's OpenAI API
    processes'): one channel more is refused, naming it, and opens once another has closed."""
    opened: list[Stream] = []
    try:
        error = next((e for _ in range(65) if (e := _try_open(grpc_url, opened)) is not None), None)
        assert error is not None and "token channels are open, the server's limit (parameter max_token_channels)" \
            in str(error), error  # (a gRPC stream's error carries its message only, not its code)
        opened.pop(0).close(cancel=True)
        for _ in range(100):  # the cancel watch asks every 50 ms
            if _try_open(grpc_url, opened) is None:
                return
            time.sleep(0.05)
        pytest.fail("no channel opened after one closed")
    finally:
        for stream in opened:
            stream.close(cancel=True)
