"""Triton requests in, Triton responses out: the client-facing side of the orchestrator model.

Streaming (``stream`` true) sends one response per token with the text delta; otherwise one response
with the whole text (prefixed by the prompt unless ``exclude_input_in_output``, as the vLLM backend
does). The last response carries ``finish_reason``, ``num_input_tokens`` and ``num_output_tokens``,
and always the final flag, also after a cancellation or an error.
"""
from __future__ import annotations

import contextlib
import logging

import numpy as np

from backends.ipc.link import StageError
from backends.triton import triton_io as io
from orchestrator.cancel_watch import CancelWatch
from orchestrator.inputs import RawRequest, parse_request
from orchestrator.sampling_params import InvalidInput
from orchestrator.send_lanes import SendLanes
from orchestrator.service import Admitted, Orchestrator

log = logging.getLogger(__name__)


def read_request(request) -> RawRequest:
    return RawRequest(
        text_input=io.bytes_list(request, "text_input"), messages=io.bytes_list(request, "messages"),
        image=io.bytes_list(request, "image"), video=io.bytes_list(request, "video"),
        image_url=io.bytes_list(request, "image_url"), video_url=io.bytes_list(request, "video_url"),
        sampling_parameters=io.bytes_list(request, "sampling_parameters"),
        stream=io.boolean(request, "stream", False),
        exclude_input_in_output=io.boolean(request, "exclude_input_in_output", False),
        return_output_ids=io.boolean(request, "return_output_ids", False))


def _response(text: str, ids: list[int], with_ids: bool, reason: str | None = None, counts=None):
    pb = io.pb()
    outputs = [io.str_tensor("text_output", [text])]
    if with_ids:
        outputs.append(io.int_tensor("output_ids", ids))
    if reason is not None:
        outputs += [io.str_tensor("finish_reason", [reason]),
                    io.int_tensor("num_input_tokens", [counts[0]], np.int32),
                    io.int_tensor("num_output_tokens", [counts[1]], np.int32)]
    return pb.InferenceResponse(outputs)


async def handle(orchestrator: Orchestrator, request, lanes: SendLanes, cancels: CancelWatch) -> None:
    """Serve one client request to the end, its responses sent on one of ``lanes``, its cancellation watched by
    ``cancels``; never raises."""
    final = io.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL
    sender, lane = request.get_response_sender(), lanes.lane()
    watched = cancels.watch(sender.is_cancelled)

    def send(response=None, flags: int = 0) -> None:
        if flags == final:  # the request is not asked about after its final response
            cancels.unwatch(watched)
        lanes.send(lane, sender, response, flags)

    try:
        parsed = parse_request(read_request(request), orchestrator.config.limits)
        admitted = await orchestrator.admit(parsed)
        # aclosing: leaving the loop early (cancellation) releases the request's pages now, not at GC.
        async with contextlib.aclosing(orchestrator.stream(admitted, watched.cancelled.is_set)) as tokens:
            await _send_tokens(orchestrator, admitted, tokens, send)
    except InvalidInput as exc:
        orchestrator.metrics.increment("unifiedserve_requests_finished", "invalid")
        send(io.error(str(exc)), final)
    except StageError as exc:
        orchestrator.metrics.increment("unifiedserve_requests_finished", "error")
        send(io.error(str(exc), invalid_argument=False), final)
    except Exception as exc:  # a bug must not leave the client hanging or kill the model
        log.exception("orchestrator: request failed")
        orchestrator.metrics.increment("unifiedserve_requests_finished", "error")
        send(io.error(f"internal error: {type(exc).__name__}: {exc}", invalid_argument=False), final)


async def _send_tokens(orchestrator: Orchestrator, admitted: Admitted, tokens, send) -> None:
    final, parsed = io.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL, admitted.parsed
    texts, ids = [], []
    async for delta, token_ids, reason in tokens:
        texts.append(delta)
        ids += token_ids
        if reason is not None:
            orchestrator.metrics.increment("unifiedserve_requests_finished", reason)
        if reason == "abort":
            send(flags=final)
            return
        counts = (len(admitted.prompt.input_ids), len(ids))
        if parsed.stream:
            send(_response(delta, token_ids, parsed.return_output_ids, reason, counts), final if reason else 0)
        elif reason is not None:
            text = "".join(texts) if parsed.exclude_input_in_output else parsed.text + "".join(texts)
            send(_response(text, ids, parsed.return_output_ids, reason, counts), final)
