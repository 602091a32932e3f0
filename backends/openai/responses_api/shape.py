"""The orchestrator's responses -> the Responses API's bodies: the whole Response object, or its stream's events
(``generation.generate`` calls a shape's ``whole`` and ``chunk`` as it calls the chat's, ``responses.ChatShape``).

A response has one output item, the assistant's message, with one ``output_text`` part (also where the text is
empty: vLLM then leaves the part out of a whole reply and sends no item events when streamed; this shape keeps
both alike). Its ``status`` is ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens`` where the
reply was cut by a length (the request's ``max_output_tokens`` or the context's end), as vLLM 0.26 answers a
``length`` finish (``ResponsesResponse.from_request``), else ``completed``.

Streamed, as vLLM 0.26's ``responses_stream_generator`` and OpenAI send them: ``response.created`` and
``response.in_progress`` (the response, no output yet), ``response.output_item.added`` and
``response.content_part.added``, then a ``response.output_text.delta`` per orchestrator response that brings text
(or, with log probabilities asked, tokens), then ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed`` with the whole response: also an incomplete one (its
``status`` says so), as vLLM sends it, and as the ``openai`` SDK's ``responses.stream()`` needs for its final
response (OpenAI sends ``response.incomplete`` instead). The first events go with the first orchestrator response,
which decides the HTTP status (``generation``). No ``[DONE]`` follows (:attr:`ResponsesShape.done`). A failure after
them (a server stopping) ends the stream with OpenAI's ``error`` event (:meth:`ResponsesShape.error`).
"""
from __future__ import annotations

import time
import uuid

from backends.openai.errors import ApiError
from backends.openai.logprobs import chat_logprobs
from backends.openai.response_schemas import TokenLogprob, Usage
from backends.openai.responses import Reply, usage
from backends.openai.responses_api.request import ResponsesRequest
from backends.openai.responses_api.schemas import (ContentPartEvent, ErrorEvent, IncompleteDetails, InputTokensDetails,
                                                   OutputItemEvent, OutputMessage, OutputText, OutputTokensDetails,
                                                   ResponseEvent, ResponseObject, ResponseUsage, StreamEvent,
                                                   TextDeltaEvent, TextDoneEvent)
from client.pieces import ResponsePiece

CLOSING_EVENTS = 4  # the text's, the part's and the item's done events and response.completed: each has the text


class ResponsesShape:
    """One response's bodies: its ``id`` (``resp_`` and 32 hex digits, or vLLM's ``request_id`` where sent), its
    message's id, ``created_at`` (Unix seconds) and the request's echoed fields are the same in all of them. One
    choice (``n`` 1); a streamed reply's events are numbered from 0 in the order they are made."""

    n = 1
    done = None  # what ends a stream after its events: nothing (the chat's: "[DONE]")

    def __init__(self, body: ResponsesRequest, model: str):
        self.id = body.request_id or f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.top_logprobs = (body.top_logprobs or 0) if body.logprobs_asked else None
        self._echo = dict(
            model=model, instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            max_tool_calls=body.max_tool_calls, parallel_tool_calls=body.parallel_tool_calls is not False,
            reasoning=body.reasoning.model_dump() if body.reasoning is not None else None,
            service_tier=body.service_tier, temperature=body.temperature, top_p=body.top_p,
            text=body.text.model_dump(by_alias=True, exclude_none=True) if body.text is not None else None,
            top_logprobs=self.top_logprobs, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, user=body.user, metadata=body.metadata)
        self._sequence = 0
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []

    def whole(self, replies: list[Reply]) -> ResponseObject:
        """The Response of the request's one reply."""
        (reply,) = replies
        return self._response(reply.text, self._entries(reply.logprobs), reply.finish_reason, reply.usage)

    def chunk_entries(self, index: int, piece: ResponsePiece) -> int:
        """How many log-probability entries the events of ``piece`` carry (``generation`` makes large ones on its
        bulk thread): its delta's, and on the last the reply's, once in each closing event."""
        new = len(piece.logprobs or ())
        return new + (CLOSING_EVENTS * (len(self._logprobs) + new) if piece.finish_reason else 0)

    def chunk(self, index: int, piece: ResponsePiece) -> list[StreamEvent]:
        """The events of ``piece``, the reply's next orchestrator response: the opening ones with its first, a
        text delta where it brings text or asked log probabilities, the closing ones with its last."""
        events = [] if self._sequence else self._opening()
        text, entries = piece.text.decode("utf-8", errors="replace"), self._entries(piece.logprobs or [])
        self._text.append(text)
        self._logprobs += entries
        if text or entries:
            events.append(TextDeltaEvent(type="response.output_text.delta", sequence_number=self._next(),
                                         item_id=self.message_id, delta=text, logprobs=entries))
        if piece.finish_reason is not None:
            events += self._closing(self._response("".join(self._text), self._logprobs, piece.finish_reason,
                                                   usage(piece)))
        return events

    def error(self, exc: ApiError) -> list[StreamEvent]:
        """The event for a failure after the stream's first events: OpenAI's ``error`` event (its API reference's
        ``ResponseErrorEvent``: ``code``, here the error's code or else its kind, ``message``, ``param``, numbered
        after the others). vLLM 0.26 means to send its chat's error body there (``serving.py``,
        ``_convert_generation_error_to_streaming_response``), which none of its event types takes: its stream breaks
        off instead."""
        return [ErrorEvent(type="error", sequence_number=self._next(), code=exc.code or exc.kind,
                           message=exc.message, param=exc.param)]

    def _opening(self) -> list[StreamEvent]:
        started = self._response_at(status="in_progress")
        message = OutputMessage(id=self.message_id, status="in_progress", content=[])
        return [ResponseEvent(type="response.created", sequence_number=self._next(), response=started),
                ResponseEvent(type="response.in_progress", sequence_number=self._next(), response=started),
                OutputItemEvent(type="response.output_item.added", sequence_number=self._next(), item=message),
                ContentPartEvent(type="response.content_part.added", sequence_number=self._next(),
                                 item_id=self.message_id, part=OutputText(text=""))]

    def _closing(self, response: ResponseObject) -> list[StreamEvent]:
        message = response.output[0]
        part = message.content[0]
        return [TextDoneEvent(type="response.output_text.done", sequence_number=self._next(), item_id=message.id,
                              text=part.text, logprobs=part.logprobs),
                ContentPartEvent(type="response.content_part.done", sequence_number=self._next(), item_id=message.id,
                                 part=part),
                OutputItemEvent(type="response.output_item.done", sequence_number=self._next(), item=message),
                ResponseEvent(type="response.completed", sequence_number=self._next(), response=response)]

    def _next(self) -> int:
        self._sequence += 1
        return self._sequence - 1

    def _entries(self, entries: list[dict]) -> list[TokenLogprob]:
        """The tokens' log probabilities as an ``output_text``'s (the chat's entries), where asked; else none."""
        return [] if self.top_logprobs is None else chat_logprobs(entries, self.top_logprobs).content

    def _response(self, text: str, logprobs: list[TokenLogprob], finish_reason: str | None,
                  counts: Usage | None) -> ResponseObject:
        """The whole response: ``finish_reason`` "length" makes it incomplete (module docstring)."""
        cut = finish_reason == "length"
        message = OutputMessage(id=self.message_id, status="incomplete" if cut else "completed",
                                content=[OutputText(text=text, logprobs=logprobs)])
        return self._response_at(status="incomplete" if cut else "completed", output=[message],
                                 incomplete_details=IncompleteDetails() if cut else None, usage=_usage(counts))

    def _response_at(self, **state) -> ResponseObject:
        return ResponseObject(id=self.id, created_at=self.created_at, **self._echo, **state)


def _usage(counts: Usage | None) -> ResponseUsage | None:
    """The chat's token counts as a response's (OpenAI's names; the cached prompt tokens as the prefix cache found
    them, as vLLM's; no reasoning tokens)."""
    if counts is None:
        return None
    details = counts.prompt_tokens_details
    return ResponseUsage(input_tokens=counts.prompt_tokens, output_tokens=counts.completion_tokens,
                         total_tokens=counts.total_tokens, output_tokens_details=OutputTokensDetails(),
                         input_tokens_details=InputTokensDetails(cached_tokens=details.cached_tokens if details else 0))
