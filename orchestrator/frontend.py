"""Triton requests in, Triton responses out: the client-facing side of the orchestrator model.

Streaming (``stream`` true) sends one response per token with the text delta; otherwise one response
with the whole text (prefixed by the prompt unless ``exclude_input_in_output``, as the vLLM backend
does). The last response carries ``finish_reason``, ``num_input_tokens``, ``num_output_tokens`` (the whole
output's) and ``num_cached_tokens`` (the prompt's tokens found in the prefix cache), and always the final flag,
also after a cancellation or an error. The vLLM backend's ``return_*``
flags put their output on every response, with that backend's meaning (its ``utils/request.py``):
``finish_reason`` is ``"None"`` until the last, ``num_output_tokens`` counts that response's tokens. Each
request's time to first token, the gaps between its outputs, its end-to-end latency, tokens and finish reason
are measured here, as its outputs are handed to its responses (``orchestrator.metrics.RequestTimer``).
"""
from __future__ import annotations

import contextlib
import json
import logging

import numpy as np

from backends.ipc.link import StageError
from backends.triton import triton_io as io
from orchestrator.cancel_watch import CancelWatch
from orchestrator.inputs import ParsedRequest, RawRequest, parse_request
from orchestrator.metrics import RequestTimer
from orchestrator.sampling_params import InvalidInput
from orchestrator.send_lanes import SendLanes
from orchestrator.service import Admitted, Orchestrator, Overloaded
from orchestrator.timeline import NO_TIMELINE, Timeline

log = logging.getLogger(__name__)

_RETURN_FLAGS = ("return_output_ids", "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                 "return_logprobs", "return_cumulative_logprob", "return_timeline")


def read_request(request) -> RawRequest:
    return RawRequest(
        text_input=io.bytes_list(request, "text_input"), messages=io.bytes_list(request, "messages"),
        prompt=io.bytes_list(request, "prompt"),
        image=io.bytes_list(request, "image"), video=io.bytes_list(request, "video"),
        image_url=io.bytes_list(request, "image_url"), video_url=io.bytes_list(request, "video_url"),
        sampling_parameters=io.bytes_list(request, "sampling_parameters"),
        stream=io.boolean(request, "stream", False),
        exclude_input_in_output=io.boolean(request, "exclude_input_in_output", False),
        **{flag: io.boolean(request, flag, False) for flag in _RETURN_FLAGS})


def _response(parsed: ParsedRequest, text: str, ids: list[int], reason: str | None, num_input: int,
              num_output: int, visual_cap: str | None = None, timeline: Timeline = NO_TIMELINE, num_cached: int = 0):
    """One response: ``ids`` the token ids it brings, ``num_output`` the tokens of the whole output so far,
    ``visual_cap`` (JSON) what max_visual_tokens changed in the request's media, for its first response; the last
    carries the request's ``timeline`` when it asked for it."""
    extra, last = parsed.extra_outputs, reason is not None
    outputs = [io.str_tensor("text_output", [text])]
    if visual_cap is not None:
        outputs.append(io.str_tensor("visual_cap", [visual_cap]))
    if last and extra.timeline:
        timeline.mark("final_response")
        outputs.append(io.str_tensor("timeline", [timeline.to_json()]))
    if parsed.return_output_ids:
        outputs.append(io.int_tensor("output_ids", ids))
    if extra.finish_reason or last:
        outputs.append(io.str_tensor("finish_reason", [str(reason)]))  # "None" until the last: the vLLM backend's str()
    if extra.num_input_tokens or last:
        outputs.append(io.int_tensor("num_input_tokens", [num_input], np.uint32))
    if extra.num_output_tokens or last:
        outputs.append(io.int_tensor("num_output_tokens", [len(ids) if extra.num_output_tokens else num_output],
                                     np.uint32))
    if last:
        outputs.append(io.int_tensor("num_cached_tokens", [num_cached], np.uint32))
    return io.pb().InferenceResponse(outputs)


async def handle(orchestrator: Orchestrator, request, lanes: SendLanes, cancels: CancelWatch,
                 arrived: float) -> None:
    """Serve one client request to the end, its responses sent on one of ``lanes``, its cancellation watched by
    ``cancels``, its latencies measured from ``arrived`` (``time.monotonic()`` seconds); never raises."""
    final = io.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL
    timer = RequestTimer(orchestrator.metrics, arrived)
    sender, lane = request.get_response_sender(), lanes.lane()
    watched = cancels.watch(sender.is_cancelled)

    def send(response=None, flags: int = 0) -> None:
        if flags == final:  # the request is not asked about after its final response
            cancels.unwatch(watched)
        lanes.send(lane, sender, response, flags)

    try:
        parsed = parse_request(read_request(request), orchestrator.config.limits)
        timeline = Timeline(arrived) if parsed.extra_outputs.timeline else NO_TIMELINE
        timeline.mark("parsed")
        admitted = await orchestrator.admit(parsed, timeline)
        timer.admitted(len(admitted.prompt.input_ids), admitted.prompt.num_visual_tokens)
        # aclosing: leaving the loop early (cancellation) releases the request's pages now, not at GC.
        async with contextlib.aclosing(orchestrator.stream(admitted, watched.cancelled.is_set)) as tokens:
            await _send_tokens(admitted, tokens, send, timer, timeline)
    except InvalidInput as exc:
        timer.finished("invalid")
        send(io.error(str(exc)), final)
    except Overloaded as exc:
        timer.finished("overloaded")
        send(io.error(str(exc), unavailable=True), final)
    except StageError as exc:
        timer.finished("error")
        send(io.error(str(exc), invalid_argument=False), final)
    except Exception as exc:  # a bug must not leave the client hanging or kill the model
        log.exception("orchestrator: request failed")
        timer.finished("error")
        send(io.error(f"internal error: {type(exc).__name__}: {exc}", invalid_argument=False), final)


async def _send_tokens(admitted: Admitted, tokens, send, timer: RequestTimer, timeline: Timeline) -> None:
    final, parsed = io.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL, admitted.parsed
    texts, ids, first = [], [], True
    cap = json.dumps(admitted.visual_cap.to_json()) if admitted.visual_cap is not None else None
    async for delta, token_ids, reason in tokens:
        texts.append(delta)
        ids += token_ids
        if token_ids:  # an abort's item carries none
            timer.output(len(token_ids))
        if reason is not None:
            timer.finished(reason)
        if reason == "abort":
            send(flags=final)
            return
        num_input = len(admitted.prompt.input_ids)
        if parsed.stream:
            if first:
                timeline.mark("first_response")
            send(_response(parsed, delta, token_ids, reason, num_input, len(ids), cap if first else None, timeline,
                           admitted.counts.cached_tokens), final if reason else 0)
            first = False
        elif reason is not None:
            text = "".join(texts) if parsed.exclude_input_in_output else parsed.text + "".join(texts)
            send(_response(parsed, text, ids, reason, num_input, len(ids), cap, timeline,
                           admitted.counts.cached_tokens), final)
