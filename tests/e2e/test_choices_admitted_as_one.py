"""A request's choices admitted as one (orchestrator/choice_reservations.py) through tritonserver, on the small KV
pool of tests/e2e/test_small_kv_pool.py (``max_waiting_requests`` 2): a first choice with ``choices`` 2 holds a place
in the waiting queue, which counts as waiting for another first choice; its later choice, naming it in
``choice_of``, is admitted when the queue is full; a first choice is refused when the queue has no room for all its
choices, and as bad input when it never could or is itself a later choice; every page comes back (a second later
choice finding no place left: tests/unit/orchestrator/test_choice_reservations.py). The OpenAI API's n uses this
(tests/e2e/test_openai_choices.py)."""
from __future__ import annotations

import queue
import threading
import time

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from client.api import grpc_inputs, request_tensors
from client.pieces import is_final
from tests.e2e.conftest import openai_sdk, read_metrics, wait_for_idle_pools
from tests.e2e.test_small_kv_pool import LONG_PROMPT, small_pool_server  # noqa: F401 (the module's server)

pytestmark = pytest.mark.e2e


def _generate(url: str, text: str, max_tokens: int, request_id: str = "", choices: int = 1,
              choice_of: str = "") -> int | str:
    """One streamed request with the orchestrator's ``choices`` / ``choice_of`` inputs where given: its output
    tokens, or its error's message."""
    inputs = grpc_inputs(request_tensors(text, sampling={"max_tokens": max_tokens, "ignore_eos": True,
                                                         "temperature": 0}, return_output_ids=True))
    for name, array, datatype in (("choices", np.array([choices], dtype=np.int64), "INT64"),
                                  ("choice_of", np.array([choice_of.encode()], dtype=np.object_), "BYTES")):
        if (name == "choices" and choices > 1) or (name == "choice_of" and choice_of):
            tensor = grpcclient.InferInput(name, [1], datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("orchestrator", inputs, request_id=request_id, enable_empty_final_response=True)
        tokens = 0
        while True:
            result, error = results.get(timeout=300)
            if error is not None:
                return error.message()
            ids = result.as_numpy("output_ids")
            tokens += 0 if ids is None else ids.size
            if is_final(result):
                return tokens
    finally:
        client.stop_stream()
        client.close()


def test_a_later_choice_takes_the_place_its_first_choice_holds(small_pool_server):  # noqa: F811
    url = f"127.0.0.1:{small_pool_server.ports.grpc}"
    results = {}

    def run(name: str, *args, **kwargs) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.__setitem__(name, _generate(url, *args, **kwargs)))
        thread.start()
        return thread

    first = run("first", "Go on.", 800, request_id="lead-1", choices=2)
    while read_metrics(small_pool_server)["unifiedserve_num_requests_running"] < 1 and first.is_alive():
        time.sleep(0.02)
    second = run("second", LONG_PROMPT, 100)  # waits for pages: with the held place, the queue is full
    while read_metrics(small_pool_server)["unifiedserve_num_requests_waiting"] < 1 and first.is_alive():
        time.sleep(0.02)
    assert first.is_alive(), "the first request ended before the second waited"
    no_room = _generate(url, "Two choices.", 4, request_id="lead-2", choices=2)  # the held place counts
    assert "the server is overloaded: 2 requests wait for KV pages (1 of them places held for other requests' " \
           "choices), of at most 2 (parameter max_waiting_requests): this request's 2 choices need as many " \
           "places" in no_room
    never = _generate(url, "Three choices.", 4, request_id="lead-3", choices=3)  # more than the queue holds
    assert "choices: 3 choices need as many places in the waiting queue, which holds at most 2" in never
    chained = _generate(url, "Go on.", 4, request_id="lead-4", choices=2, choice_of="lead-1")
    assert "choices: a later choice (one naming a request in choice_of) holds no places of its own" in chained
    bad = _generate(url, "Go on.", 4, choices=2)  # no request id to name
    assert "choices: a request whose choices are admitted as one needs a request id" in bad
    assert _generate(url, "Go on.", 4, choice_of="lead-1") == 4  # its place, whatever the load
    for thread in (first, second):
        thread.join(timeout=300)
    assert (results["first"], results["second"]) == (800, 100)
    wait_for_idle_pools(small_pool_server)


def test_an_openai_n_the_waiting_queue_can_never_hold_is_a_400_naming_n(small_pool_server, tmp_path):  # noqa: F811
    with openai_sdk(small_pool_server, tmp_path) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=3,
                                           max_tokens=2)
        error = refused.value.body
        assert error["param"] == "n" and error["message"].startswith(
            "n: 3 choices need as many places in the waiting queue, which holds at most 2")
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                              max_tokens=2)
        assert sorted(choice.index for choice in chat.choices) == [0, 1]
