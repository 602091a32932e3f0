"""Triton requests in, Triton responses out: the client-facing side of the orchestrator model.

Streaming (``stream`` true) sends one response per output item with the text delta (a send lane that fell behind
merges a request's queued replies into one: ``orchestrator.replies``); otherwise one response with the whole text
(prefixed by the prompt unless ``exclude_input_in_output``, as the vLLM backend does). The first response carries
``media`` (what was done with each image and video) and ``visual_cap`` (what max_visual_tokens changed) where the
request has them (``orchestrator.replies.first_outputs``). The last response carries
``finish_reason``, ``num_input_tokens``, ``num_output_tokens`` (the whole output's), ``num_cached_tokens`` (the
prompt's tokens found in the prefix cache) and ``stop_reason`` (JSON: the stop string or token id that ended the
output, else null; vLLM's), and always the final flag, also after a cancellation or an error. The
vLLM backend's ``return_*`` flags put their output on every response, with that backend's meaning (its
``utils/request.py``): ``finish_reason`` is ``"None"`` until the last, ``num_output_tokens`` counts that
response's tokens; ``return_num_input_tokens`` brings ``num_cached_tokens`` with it (the prompt's counts, known from
the first token on). A client's cancellation, seen by the cancel watch's thread, is handed to the event loop, where
it ends the request's stream. Each request's time to first token, the gaps between its outputs, its end-to-end
latency, tokens and finish reason are measured here, as its outputs are handed to its responses
(``orchestrator.metrics.RequestTimer``).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import numpy as np

from backends.ipc.link import StageError
from backends.triton import triton_io as io
from orchestrator.cancel_watch import CancelWatch
from orchestrator.choice_reservations import choice_of_input, choices_input
from orchestrator import request_parameters
from orchestrator.inputs import ParsedRequest, RawRequest, builds_a_grammar, parse_request
from orchestrator.metrics import RequestTimer
from orchestrator.off_loop import INLINE_TOKEN_IDS
from orchestrator.replies import Built, Reply, first_outputs
from orchestrator.sampling_params import InvalidInput
from orchestrator.send_lanes import SendLanes
from orchestrator.service import Admitted, Orchestrator, Overloaded
from orchestrator.timeline import NO_TIMELINE, Timeline
from orchestrator.token_channels import TokenChannels, channel_name, routed

log = logging.getLogger(__name__)

_RETURN_FLAGS = ("return_output_ids", "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                 "return_logprobs", "return_cumulative_logprob", "return_timeline", "return_input_ids")


def read_request(request) -> RawRequest:
    arrays = io.input_arrays(request)
    return RawRequest(
        text_input=io.bytes_list(arrays, "text_input"), messages=io.bytes_list(arrays, "messages"),
        prompt=io.bytes_list(arrays, "prompt"), prompt_token_ids=io.int_list(arrays, "prompt_token_ids"),
        open_token_channel=io.bytes_list(arrays, "open_token_channel"),
        choices=io.int_list(arrays, "choices"), choice_of=io.bytes_list(arrays, "choice_of"),
        token_channel=io.bytes_list(arrays, "token_channel"),
        chat_template_kwargs=io.bytes_list(arrays, "chat_template_kwargs"),
        image=io.bytes_list(arrays, "image"), video=io.bytes_list(arrays, "video"),
        image_url=io.bytes_list(arrays, "image_url"), video_url=io.bytes_list(arrays, "video_url"),
        sampling_parameters=io.bytes_list(arrays, "sampling_parameters"),
        stream=io.boolean(arrays, "stream", False), tokenize_only=io.boolean(arrays, "tokenize_only", False),
        return_input_tokens=io.boolean(arrays, "return_input_tokens", True),
        exclude_input_in_output=io.boolean(arrays, "exclude_input_in_output", False),
        parameters=request_parameters.sampling_text(request.parameters()) or "",
        **{flag: io.boolean(arrays, flag, False) for flag in _RETURN_FLAGS})


async def handle(orchestrator: Orchestrator, request, lanes: SendLanes, cancels: CancelWatch,
                 channels: TokenChannels, arrived: float) -> None:
    """Serve one client request to the end, its responses sent on one of ``lanes`` (a streamed request bound to a
    token channel: its replies on the channel's, ``orchestrator.token_channels``), its cancellation watched by
    ``cancels`` once admitted, its latencies measured from ``arrived`` (``time.monotonic()`` seconds); a request
    opening a channel holds it open (``TokenChannels.serve``). Never raises."""
    final = io.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL
    timer = RequestTimer(orchestrator.metrics, arrived)
    sender, lane, watched, admitting = request.get_response_sender(), lanes.lane(), None, True
    channel, request_id = None, ""  # the token channel its replies go on, its id there
    holding = ""  # the request id whose places held for its later choices are given back at its end
    ended = False  # its final response sent (on a channel, that frees its id: routed)

    def send(item: Reply | Built) -> None:
        nonlocal ended
        if item.flags == final and watched is not None:  # the request is not asked about after its final response
            cancels.unwatch(watched)
        ended = ended or item.flags == final
        if channel is not None:
            item = routed(channel, request_id, item, lanes, final)
        if item is not None:
            lanes.send(lane, sender, item)

    try:
        raw = read_request(request)
        opening = channel_name(raw.open_token_channel, "open_token_channel")
        timer.counted = not (opening or raw.tokenize_only)  # no generation: not in the requests' metrics
        if opening:
            admitting = False
            orchestrator.admission_ended()
            await _serve_channel(opening, raw, sender, channels, lanes, cancels)
            return
        limits, defaults = orchestrator.config.limits, orchestrator.config.generation.sampling
        parsed = await asyncio.to_thread(parse_request, raw, limits, defaults) if builds_a_grammar(raw) else \
            parse_request(raw, limits, defaults)
        if raw.tokenize_only:
            send(Built(await _tokenized(orchestrator, parsed, raw), final))
            return
        bound = channel_name(raw.token_channel, "token_channel")
        if bound:
            request_id = request.request_id()
            channel = channels.claim(bound, request_id, parsed.stream)  # its id is freed by its final response
        choices, choice_of = choices_input(raw.choices), choice_of_input(raw.choice_of)
        timeline = Timeline(arrived) if parsed.extra_outputs.timeline else NO_TIMELINE
        timeline.mark("parsed")
        admitted = await orchestrator.admit(parsed, timeline, choices, choice_of, request.request_id())
        holding = request.request_id() if choices > 1 else ""
        admitting = False
        orchestrator.admission_ended()
        timer.admitted(len(admitted.prompt.input_ids), admitted.prompt.num_visual_tokens)
        loop = asyncio.get_running_loop()
        watched = cancels.watch(sender.is_cancelled,
                                lambda: loop.call_soon_threadsafe(orchestrator.cancel, admitted))
        if channel is not None:
            channel.bind(request_id, lambda: orchestrator.cancel(admitted))
        # aclosing: leaving the loop early (cancellation) releases the request's pages now, not at GC.
        async with contextlib.aclosing(orchestrator.stream(admitted)) as tokens:
            await _send_tokens(admitted, tokens, send, timer, timeline, trail_timeline=channel is not None)
    except InvalidInput as exc:
        timer.finished("invalid")
        send(Built(io.error(str(exc), request_id=request.request_id()), final))
    except Overloaded as exc:
        timer.finished("overloaded")
        send(Built(io.error(str(exc), unavailable=True, request_id=request.request_id()), final))
    except StageError as exc:
        timer.finished("error")
        send(Built(io.error(str(exc), invalid_argument=False, request_id=request.request_id()), final))
    except Exception as exc:  # a bug must not leave the client hanging or kill the model
        log.exception("orchestrator: request failed")
        timer.finished("error")
        send(Built(io.error(f"internal error: {type(exc).__name__}: {exc}", invalid_argument=False,
                            request_id=request.request_id()), final))
    finally:
        if admitting:  # refused, failed or cancelled before it was admitted
            orchestrator.admission_ended()
        if channel is not None and not ended:  # cancelled with no final response (the model stopping): free its id
            channel.free(request_id)
        if holding:
            orchestrator.reservations.ended(holding)


def _given(raw: RawRequest, field: dataclasses.Field) -> bool:
    """Whether the request sent input ``field``: its value is not the field's default (an empty one where it has
    none, as ``text_input``)."""
    value = getattr(raw, field.name)
    if field.default is not dataclasses.MISSING:
        return value != field.default
    if field.default_factory is not dataclasses.MISSING:
        return value != field.default_factory()
    return bool(value)


async def _serve_channel(name: str, raw: RawRequest, sender, channels: TokenChannels, lanes: SendLanes,
                         cancels: CancelWatch) -> None:
    """Hold channel ``name`` open (``TokenChannels.serve``); raises InvalidInput when the request has other inputs
    than the channel's name."""
    given = [f.name for f in dataclasses.fields(raw) if f.name != "open_token_channel" and _given(raw, f)]
    if given:
        raise InvalidInput(f"open_token_channel: a request opening a channel carries no other input, got "
                           f"{', '.join(given)} (send those in requests naming it in token_channel)")
    await channels.serve(name, sender, lanes, cancels)


async def _tokenized(orchestrator: Orchestrator, parsed: ParsedRequest, raw: RawRequest):
    """A ``tokenize_only`` request's one response (``Orchestrator.tokenize``): ``input_ids``, ``input_tokens`` (unless
    ``return_input_tokens`` is false: a million token strings cost about 250 ms of the orchestrator's GIL to
    serialize, and as much to the client to read), ``num_input_tokens``; ``media`` and ``visual_cap`` where it has
    media, ``prompt_text`` for ``prompt_token_ids``.
    Raises InvalidInput as admission's planning does, or for a ``token_channel`` (the response is the request's own).
    A long prompt's response is built in a worker thread: a 1-MiB prompt's 786k token strings held the event loop,
    and the other requests' tokens, for over 100 ms (a fresh user's test)."""
    if raw.token_channel:
        raise InvalidInput("token_channel: a tokenize_only request is answered on its own stream (leave it out)")
    tokens = await orchestrator.tokenize(parsed, raw.return_input_tokens)
    ids = list(tokens.prompt.input_ids)
    head = first_outputs(visual_cap=None if tokens.visual_cap is None else tokens.visual_cap.to_json(),
                         media=tokens.media, prompt_text=tokens.prompt_text)

    def response():
        return io.pb().InferenceResponse([
            io.number_tensor("input_ids", ids),
            *([io.str_tensor("input_tokens", tokens.token_strings)] if raw.return_input_tokens else []),
            io.number_tensor("num_input_tokens", [len(ids)], np.uint32), *(io.str_tensor(k, [v]) for k, v in head)])
    return await asyncio.to_thread(response) if len(ids) > INLINE_TOKEN_IDS else response()


async def _send_tokens(admitted: Admitted, tokens, send, timer: RequestTimer, timeline: Timeline,
                       trail_timeline: bool = False) -> None:
    """Hand the request's ``tokens`` (``Orchestrator.stream``) to ``send`` as replies: one per item when
    streaming, else one with the whole text at the end; an abort ends it with an empty final response. With
    ``trail_timeline`` (a request on a token channel) a streamed request's timeline (``return_timeline``) comes
    after its last tokens, in an entry of its own (``Reply.trailing``): the JSON is built once they have been sent,
    and holds their send. On a request's own stream it stays on the last tokens' final response: a client that
    cancels between the two (it has all its tokens) would cancel a request Triton is finishing, which left
    Triton 2.51 unable to unload the orchestrator at stop (a fresh user's test, 2026-12-04)."""
    final, parsed = io.pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL, admitted.parsed
    texts, ids, entries, first = [], [], [], True
    cap = None if admitted.visual_cap is None else admitted.visual_cap.to_json()
    head = first_outputs(visual_cap=cap, media=admitted.media, prompt_text=admitted.prompt_text)
    if parsed.extra_outputs.input_ids:  # the prompt as it runs: chat template applied, visual placeholders expanded
        head += (("input_ids", list(admitted.prompt.input_ids)),)
    num_input = len(admitted.prompt.input_ids)
    async for delta, token_ids, reason, logprobs, cumulative, prompt_logprobs, stop_reason in tokens:
        if prompt_logprobs is not None:  # on the first item (JSON already): the first response's
            head += (("prompt_logprobs", prompt_logprobs),)
        texts.append(delta)
        ids += token_ids
        if not parsed.stream:  # a streamed reply sends each item's own
            entries += logprobs
        if token_ids:  # an abort's item carries none
            timer.output(len(token_ids))
        if reason is not None:
            timer.finished(reason)
        if reason == "abort":
            send(Built(flags=final))
            return
        if parsed.stream:
            if first:
                timeline.mark("first_response")
            if reason is not None and trail_timeline and parsed.extra_outputs.timeline and (delta or token_ids):
                # the last tokens go out before the timeline's JSON is built, in a reply of their own
                send(Reply(parsed, delta, token_ids, None, num_input, len(ids), 0, head if first else (), timeline,
                           admitted.counts.cached_tokens, logprobs, cumulative))
                delta, token_ids, logprobs, first = "", [], (), False
            send(Reply(parsed, delta, token_ids, reason, num_input, len(ids), final if reason else 0,
                       head if first else (), timeline, admitted.counts.cached_tokens, logprobs, cumulative,
                       stop_reason))
            first = False
        elif reason is not None:
            prompt = parsed.text if admitted.prompt_text is None else admitted.prompt_text
            text = "".join(texts) if parsed.exclude_input_in_output else prompt + "".join(texts)
            send(Reply(parsed, text, ids, reason, num_input, len(ids), final, head, timeline,
                       admitted.counts.cached_tokens, tuple(entries), cumulative, stop_reason))
