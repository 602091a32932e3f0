"""A request's outputs as its client sees them (``orchestrator.output_processor``): tokens that queued up while
the request's handler was busy leave as one item (one client response), with the same ids and text as one by
one; stop strings end the output at the right token and abort the request; a failure comes after the tokens
before it, typed as the stage said; a cancellation ends the stream after the tokens queued before it, also while
no token comes; the request is always aborted in its engine at the end; tokens with log probabilities get the vLLM
backend's entries and the output's running sum."""
import asyncio
import json
import threading
import time

import numpy as np
import pytest

from backends.ipc.link import StageError
from backends.ipc.protocol import INVALID_INPUT, SERVER_FAULT, PromptLogprobs, StageFailure, TokenLogprobs
from backends.runtime.tokenizer import load_tokenizer
from orchestrator.cancel_watch import CancelWatch
from orchestrator.engine_io import Output
from orchestrator.output_processor import MIN_LOGPROB, OutputProcessor
from orchestrator.sampling_params import InvalidInput, RequestParams

TOKENIZER = load_tokenizer(None)
WORDS = TOKENIZER.encode(" one two three four five six seven eight")


class Engine:
    """What the output processor needs of an engine: ``abort``, recorded."""

    def __init__(self):
        self.aborted: list[str] = []

    async def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)


def stream(outputs: list[Output], cancel=False, prompt_ids=(), **params):
    """Every item of the stream of a request whose ``outputs`` are all queued before it starts (then a
    cancellation, with ``cancel``), the exception it ended with (or None), and the requests aborted."""

    async def run():
        queue, engine, items = asyncio.Queue(), Engine(), []
        for output in outputs:
            queue.put_nowait(output)
        if cancel:
            OutputProcessor.cancel(queue)
        try:
            async for item in OutputProcessor(TOKENIZER).stream(engine, "r", queue, RequestParams(**params),
                                                                prompt_ids):
                items.append(item)
        except Exception as exc:  # noqa: BLE001 - returned for the test to check
            return items, exc, engine.aborted
        return items, None, engine.aborted

    return asyncio.run(asyncio.wait_for(run(), 10))


def tokens(ids, last_reason="length"):
    return [Output(t, last_reason if i == len(ids) - 1 else "") for i, t in enumerate(ids)]


def test_queued_tokens_leave_as_one_item_with_the_same_ids_and_text():
    items, error, aborted = stream(tokens(WORDS), max_tokens=100)
    assert error is None and len(items) == 1 and aborted == ["r"]
    text, ids, reason, logprobs = items[0][:4]
    assert ids == WORDS and reason == "length" and text == TOKENIZER.decode(WORDS) and logprobs == ()


def test_a_stop_string_ends_inside_a_batch_of_queued_tokens():
    items, _, aborted = stream(tokens(WORDS, last_reason=""), max_tokens=100, stop=["four"])
    text, ids, reason = items[-1][:3]
    assert reason == "stop" and "four" not in text and text.strip() == "one two three" and aborted == ["r"]
    assert ids == WORDS[:len(ids)] and len(ids) < len(WORDS)  # the tokens after the stop string are not sent


def test_the_token_that_stops_the_output_is_out_but_not_its_text_unless_asked():
    # vLLM v1's detokenizer skips the text of the eos or stop_token_ids token that stopped the output (reason
    # "stop" from the stage), unless include_stop_str_in_output; a stop string stays with it too
    items, _, _ = stream(tokens(WORDS, last_reason="stop"), max_tokens=100)
    assert items[-1].ids == WORDS and items[-1].text == TOKENIZER.decode(WORDS[:-1])
    items, _, _ = stream(tokens(WORDS, last_reason="stop"), max_tokens=100, include_stop_str_in_output=True)
    assert items[-1].text == TOKENIZER.decode(WORDS)
    items, _, _ = stream(tokens(WORDS, last_reason=""), max_tokens=100, stop=["four"],
                         include_stop_str_in_output=True)
    assert items[-1].reason == "stop" and items[-1].text.strip() == "one two three four"


def test_the_last_item_names_what_stopped_the_output_as_vllms_stop_reason():
    """The stop string matched, a stop token's id, None for the tokenizer's eos token (vLLM's check_stop) and for
    any other end; the items before the last carry none."""
    items, _, _ = stream(tokens(WORDS, last_reason=""), max_tokens=100, stop=["nine", "four"])
    assert items[-1].stop_reason == "four" and all(item.stop_reason is None for item in items[:-1])
    stop_token = WORDS[-1]
    assert stream(tokens(WORDS, last_reason="stop"), max_tokens=100)[0][-1].stop_reason == stop_token
    eos = tokens([*WORDS, TOKENIZER.eos_token_id], last_reason="stop")
    assert stream(eos, max_tokens=100)[0][-1].stop_reason is None
    assert stream(tokens(WORDS), max_tokens=100)[0][-1].stop_reason is None  # "length"
    assert stream(tokens(WORDS, last_reason=""), cancel=True, max_tokens=100)[0][-1].stop_reason is None


def test_a_failure_comes_after_the_tokens_before_it_typed_as_the_stage_said():
    items, error, _ = stream([*tokens(WORDS[:2], last_reason=""),
                              Output(failure=StageFailure(SERVER_FAULT, "decode: the decode step failed"))])
    assert [item.ids for item in items] == [WORDS[:2]] and items[0].reason is None
    assert isinstance(error, StageError) and "the decode step failed" in str(error)
    _, error, _ = stream([Output(failure=StageFailure(INVALID_INPUT, "video: no keyframe"))])
    assert isinstance(error, InvalidInput) and str(error) == "video: no keyframe"


def test_a_cancelled_client_ends_the_stream_with_abort_after_the_tokens_queued_before():
    items, error, aborted = stream([], cancel=True)
    assert items == [("", [], "abort", (), 0.0, None, None)] and error is None and aborted == ["r"]
    items, error, aborted = stream(tokens(WORDS[:3], last_reason=""), cancel=True, max_tokens=100)
    assert [item.ids for item in items] == [WORDS[:3], []] and items[-1].reason == "abort" and aborted == ["r"]


def test_a_cancellation_from_the_watch_thread_ends_a_stream_that_waits_for_tokens():
    """The frontend's path: the cancel watch's thread hands the cancellation to the loop; no token comes after
    the first, and the stream ends (with no further tokens) within about the watch's period."""

    async def run():
        loop, queue, engine = asyncio.get_running_loop(), asyncio.Queue(), Engine()
        watch = CancelWatch(period_s=0.01)
        asked = threading.Event()

        def is_cancelled():
            return asked.is_set()

        watch.watch(is_cancelled, lambda: loop.call_soon_threadsafe(OutputProcessor.cancel, queue))
        queue.put_nowait(Output(WORDS[0]))
        items = []
        try:
            async for item in OutputProcessor(TOKENIZER).stream(engine, "r", queue, RequestParams(max_tokens=100)):
                items.append(item)
                if len(items) == 1:
                    asked.set()
                    started = time.monotonic()
        finally:
            watch.close()
        return items, time.monotonic() - started, engine.aborted

    items, waited_s, aborted = asyncio.run(asyncio.wait_for(run(), 10))
    assert [(item.ids, item.reason) for item in items] == [([WORDS[0]], None), ([], "abort")]
    assert waited_s < 1.0 and aborted == ["r"]


def test_tokens_with_log_probabilities_get_the_vllm_backends_entries_and_their_running_sum():
    """Per token ``{"<id>": {"logprob", "rank", "decoded_token"}}``, the sampled token first with its own rank, then
    the top tokens ranked 1, 2, ... (one already there keeps its entry); the sum runs over the whole output."""
    first = TokenLogprobs(-0.5, 2, ((WORDS[1], -0.25), (WORDS[0], -0.5)))
    last = Output(WORDS[1], "length", logprobs=TokenLogprobs(-1.0, 3))
    items, error, _ = stream([Output(WORDS[0], logprobs=first), last], max_tokens=100)
    assert error is None and len(items) == 1
    (one, two), total = items[0].logprobs, items[0].cumulative_logprob
    assert list(one) == [str(WORDS[0]), str(WORDS[1])] and total == -1.5
    assert one[str(WORDS[0])] == {"logprob": -0.5, "rank": 2, "decoded_token": TOKENIZER.decode([WORDS[0]])}
    assert one[str(WORDS[1])] == {"logprob": -0.25, "rank": 1, "decoded_token": TOKENIZER.decode([WORDS[1]])}
    assert two == {str(WORDS[1]): {"logprob": -1.0, "rank": 3, "decoded_token": TOKENIZER.decode([WORDS[1]])}}


def test_an_infinite_or_nan_log_probability_is_floored_as_vllm_floors_it():
    """JSON has no -inf or NaN: the entries (and their sum) floor them at MIN_LOGPROB."""
    figures = TokenLogprobs(float("-inf"), 9, ((WORDS[1], float("nan")),))
    items, _, _ = stream([Output(WORDS[0], "length", logprobs=figures)], max_tokens=100)
    (entry,) = items[0].logprobs
    assert [v["logprob"] for v in entry.values()] == [MIN_LOGPROB, MIN_LOGPROB]
    assert items[0].cumulative_logprob == MIN_LOGPROB


def test_the_first_item_carries_the_prompts_entries_the_first_tokens_with_null_figures():
    """``prompt_logprobs``: JSON, per prompt token its entry as the output's (the top tokens after it), the first
    token's text alone with null figures (it follows nothing)."""
    prompt = WORDS[:3]
    figures = np.array([[-0.5, 2, WORDS[5], -0.25], [-3.0, 1, WORDS[2], -3.0]], np.float32)
    first = Output(WORDS[3], "length", prompt_logprobs=PromptLogprobs(figures.tobytes(), 1))
    items, error, _ = stream([first], prompt_ids=prompt, max_tokens=100)
    assert error is None and len(items) == 1
    entries = json.loads(items[0].prompt_logprobs)
    text = [TOKENIZER.decode([t]) for t in WORDS]
    assert entries == [
        {str(WORDS[0]): {"logprob": None, "rank": None, "decoded_token": text[0]}},
        {str(WORDS[1]): {"logprob": -0.5, "rank": 2, "decoded_token": text[1]},
         str(WORDS[5]): {"logprob": -0.25, "rank": 1, "decoded_token": text[5]}},
        {str(WORDS[2]): {"logprob": -3.0, "rank": 1, "decoded_token": text[2]}}]
    assert stream(tokens(WORDS[:2]), max_tokens=100)[0][0].prompt_logprobs is None  # not asked


def test_the_prompts_entries_written_as_text_equal_the_output_tokens_entries():
    """The prompt's JSON (written as text) holds, per token, what ``logprobs``' entry of a sampled token with the
    same figures holds: itself first, the top tokens after it without it, floored values; a count of figures that
    does not match the prompt is refused."""
    rng = np.random.default_rng(0)
    prompt = WORDS[:6]
    figures = np.zeros((5, 8), np.float32)
    for row, token in enumerate(prompt[1:]):
        tops = [token, *rng.choice([w for w in WORDS if w != token], 2, replace=False)] if row % 2 else \
            list(rng.choice([w for w in WORDS if w != token], 3, replace=False))
        values = sorted(rng.uniform(-5, 0, 3), reverse=True)
        figures[row] = [-float("inf") if row == 4 else -2.5, 1 + row, *tops, *values]
    figures[3, 6] = float("inf")  # not finite either way: floored (JSON has no infinity)
    processor = OutputProcessor(TOKENIZER)
    text = processor._prompt_json(prompt, PromptLogprobs(figures.tobytes(), 3))
    expected = [processor._entry(t, TokenLogprobs(float(f[0]), int(f[1]), tuple(zip(map(int, f[2:5]),
                                                                                  map(float, f[5:])))))
                for t, f in zip(prompt[1:], figures)]
    assert json.loads(text)[1:] == json.loads(json.dumps(expected))
    with pytest.raises(ValueError, match="5 prompt log probabilities for 3 prompt tokens"):
        processor._prompt_json(prompt[:3], PromptLogprobs(figures.tobytes(), 3))
