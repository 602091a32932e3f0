"""The orchestrator's responses -> OpenAI's bodies: a whole chat completion or completion, or its streamed chunks.

Each orchestrator response carries the text made since the last one (UTF-8, whole characters), its token ids when
asked for, and, on the last, ``finish_reason``, ``stop_reason`` and the prompt's and the reply's token counts
(``usage``).
"""
from __future__ import annotations

import time
import uuid

from backends.openai.errors import ApiError
from backends.openai.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from backends.openai.response_schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                              ChatCompletionChunk, ChatLogprobs, Completion, CompletionChoice,
                                              CompletionLogprobs, Delta, ErrorResponse, PromptTokensDetails, Usage)
from backends.openai.tool_calls import ToolReplies
from client.pieces import ResponsePiece


def usage(piece: ResponsePiece, completion_tokens: int | None = None) -> Usage | None:
    """The token counts of a request's last response (None on the others), or, given ``completion_tokens`` (the
    reply's tokens so far), of any response that brings the prompt's counts (``continuous_usage``)."""
    completion_tokens = piece.num_output_tokens if completion_tokens is None else completion_tokens
    if piece.num_input_tokens is None or completion_tokens is None:
        return None
    details = None if piece.num_cached_tokens is None else PromptTokensDetails(cached_tokens=piece.num_cached_tokens)
    return Usage(prompt_tokens=piece.num_input_tokens, completion_tokens=completion_tokens,
                 total_tokens=piece.num_input_tokens + completion_tokens, prompt_tokens_details=details)


def total_usage(usages: dict[int, Usage], n: int) -> Usage | None:
    """The request's usage from its choices' (by choice index; ``n`` choices a prompt): each prompt's tokens (and
    cached tokens) counted once, from its first choice, and every choice's completion tokens, as vLLM counts them.
    None when no choice has one."""
    if not usages:
        return None
    firsts = [counts for index, counts in usages.items() if index % n == 0]
    prompt = sum(counts.prompt_tokens for counts in firsts)
    completion = sum(counts.completion_tokens for counts in usages.values())
    cached = [counts.prompt_tokens_details.cached_tokens for counts in firsts if counts.prompt_tokens_details]
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached)) if cached else None)


class Reply:
    """A whole reply gathered from its responses: ``text``, ``token_ids``, ``finish_reason``, ``stop_reason``,
    ``usage``, ``visual_cap`` (what max_visual_tokens lowered, or None), ``media`` (what was done with each image
    and video, or None without media), ``timeline`` (with ``return_timeline``, or None), ``logprobs`` (the
    orchestrator's entries, one per token, where asked), ``prompt_logprobs`` (its entries of the prompt's tokens,
    where asked), ``prompt_text`` (a token-id prompt's text), ``prompt_ids`` (the prompt's token ids as it ran, where
    asked: ``return_input_ids``)."""

    def __init__(self):
        self._text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.usage: Usage | None = None
        self.visual_cap: dict | None = None
        self.media: list[dict] | None = None
        self.timeline: dict | None = None
        self.prompt_logprobs: list[dict] | None = None
        self.prompt_text: str | None = None
        self.prompt_ids: tuple[int, ...] | None = None

    def add(self, piece: ResponsePiece) -> None:
        self._text.append(piece.text.decode("utf-8", errors="replace"))
        self.token_ids += piece.token_ids
        self.logprobs += piece.logprobs or ()
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.stop_reason = self.stop_reason if piece.stop_reason is None else piece.stop_reason
        self.usage = usage(piece) or self.usage
        self.visual_cap = piece.visual_cap or self.visual_cap
        self.media = piece.media or self.media
        self.timeline = piece.timeline or self.timeline
        self.prompt_logprobs = piece.prompt_logprobs or self.prompt_logprobs
        self.prompt_text = piece.prompt_text or self.prompt_text
        self.prompt_ids = piece.input_ids or self.prompt_ids

    @property
    def text(self) -> str:
        return "".join(self._text)


class _Shape:
    """One request's bodies: its id, creation time (Unix seconds) and model name are the same in all of them. Choice
    ``k`` is prompt ``k // n``'s; the request-wide extras (``visual_cap``, ``media``, ``timeline``) are choice 0's."""

    prefix = ""
    done = "[DONE]"  # a stream's last event after its chunks (``generation``)

    def __init__(self, model: str, return_token_ids: bool, top_logprobs: int | None = None, n: int = 1,
                 continuous_usage: bool = False, *, request_id: str | None = None):
        """``top_logprobs``: the request's log probabilities (the top tokens' count; None: not asked); ``n``: choices
        a prompt; ``continuous_usage``: every chunk carries its choice's usage so far (vLLM's
        ``stream_options.continuous_usage_stats``; the orchestrator's responses then bring the prompt's token count
        and the token ids, ``convert.OrchestratorRequest``); ``request_id``: the bodies' ``id`` after the prefix
        (``request_ids.reply_id``; None: a random one)."""
        self.id = f"{self.prefix}-{uuid.uuid4().hex if request_id is None else request_id}"
        self.created = int(time.time())
        self.model = model
        self.return_token_ids = return_token_ids
        self.top_logprobs = top_logprobs
        self.n = n
        self.continuous_usage = continuous_usage
        self._noted: dict[int, dict[str, list]] = {}  # per prompt, what its first choice brought (_from_first_choice)
        self._started: set[int] = set()  # the choices whose first chunk is made
        self._usages: dict[int, Usage] = {}  # streamed choices' usage, from their last chunks
        self._made: dict[int, int] = {}  # with continuous_usage: each choice's tokens streamed so far

    def error(self, exc: ApiError) -> ErrorResponse:
        """What a stream sends for an error after its first chunk: the error's body, ``{"error": {...}}``, on its
        ``data:`` line (vLLM's ``create_streaming_error_response``)."""
        return exc.model()

    def _ids(self, token_ids) -> list[int] | None:
        return list(token_ids) if self.return_token_ids else None

    def _first_chunk(self, index: int, piece: ResponsePiece) -> bool:
        """Whether ``piece`` makes choice ``index``'s first chunk; notes its usage (on its last)."""
        if (counts := usage(piece)) is not None:
            self._usages[index] = counts
        if index in self._started:
            return False
        self._started.add(index)
        return True

    def _running_usage(self, index: int, piece: ResponsePiece) -> Usage | None:
        """With ``continuous_usage``, choice ``index``'s usage as of ``piece``: its prompt's tokens (and cached
        tokens, as the last usage gives them) and the choice's tokens so far (vLLM's continuous usage: per choice),
        the whole usage on its last; else None."""
        if not self.continuous_usage:
            return None
        self._made[index] = self._made.get(index, 0) + len(piece.token_ids)
        return usage(piece) or usage(piece, self._made[index])

    def streamed_usage(self) -> Usage | None:
        """The usage of the choices streamed so far (``total_usage``)."""
        return total_usage(self._usages, self.n)

    def _whole_usage(self, replies: list[Reply]) -> Usage | None:
        return total_usage({index: reply.usage for index, reply in enumerate(replies) if reply.usage}, self.n)

    def chunk_entries(self, index: int, piece: ResponsePiece) -> int:
        """How many log-probability entries choice ``index``'s chunk of ``piece`` carries: its tokens', and on a
        choice's first chunk its prompt's (``piece``'s, or its prompt's first choice's: ``_prompt_entries``)."""
        prompt = piece.prompt_logprobs or (self._from_first_choice(index, "logprobs", None)
                                           if index not in self._started else None)
        return len(piece.logprobs or ()) + len(prompt or ())

    def _prompt_token_ids(self, index: int, ids: tuple[int, ...] | None) -> list[int] | None:
        """With ``return_token_ids``, choice ``index``'s prompt's token ids (vLLM's ``prompt_token_ids``): ``ids``,
        which a prompt's first choice brings (``Reply.prompt_ids``, ``ResponsePiece.input_ids``: its others do not
        ask, ``choices.sample_requests``), noted for the others; else None."""
        if not self.return_token_ids:
            return None
        return self._from_first_choice(index, "ids", None if ids is None else list(ids))

    def _prompt_entries(self, index: int, reply: Reply | ResponsePiece) -> list[dict] | None:
        """The orchestrator's entries of choice ``index``'s prompt (None where not asked): ``reply``'s, which a
        prompt's first choice brings (its others do not ask: ``choices.sample_requests``), noted for the others."""
        return self._from_first_choice(index, "logprobs", reply.prompt_logprobs)

    def _from_first_choice(self, index: int, name: str, value: list | None) -> list | None:
        """A figure of choice ``index``'s prompt named ``name`` that only the prompt's first choice brings (its others
        do not ask: ``choices.sample_requests``): ``value`` where given, noted for the others; else the noted one
        (None: not noted)."""
        noted = self._noted.setdefault(index // self.n, {})
        if value is not None:
            noted[name] = value
        return noted.get(name)


class ChatShape(_Shape):
    """``chat.completion`` and ``chat.completion.chunk`` bodies; each choice's first chunk carries the assistant's
    role. ``echo``: the text each choice's message starts with (vLLM's chat ``echo``: ``ChatCompletionRequest.
    echoed``), else empty. ``tools``: the replies are tool calls (a named function's or "required"'s:
    ``backends.openai.tool_calls``), else None."""

    prefix = "chatcmpl"

    def __init__(self, model: str, return_token_ids: bool, top_logprobs: int | None = None, n: int = 1,
                 continuous_usage: bool = False, echo: str = "", tools: ToolReplies | None = None, *,
                 request_id: str | None = None):
        super().__init__(model, return_token_ids, top_logprobs, n, continuous_usage, request_id=request_id)
        self.echo = echo
        self.tools = tools

    def whole(self, replies: list[Reply]) -> ChatCompletion:
        choices = [ChatChoice(index=index, message=self._message(reply), logprobs=self._logprobs(reply.logprobs),
                              finish_reason=self.tools.finish_reason(reply.finish_reason) if self.tools
                              else reply.finish_reason, stop_reason=reply.stop_reason,
                              token_ids=self._ids(reply.token_ids))
                   for index, reply in enumerate(replies)]
        first = replies[0]
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices,
                              usage=self._whole_usage(replies), visual_cap=first.visual_cap, media=first.media,
                              timeline=first.timeline, prompt_logprobs=prompt_logprobs(first.prompt_logprobs),
                              prompt_token_ids=self._prompt_token_ids(0, first.prompt_ids))

    def _message(self, reply: Reply) -> AssistantMessage:
        if self.tools is None:
            return AssistantMessage(content=self.echo + reply.text)
        return AssistantMessage(content=self.echo, tool_calls=self.tools.calls(reply.text))

    def chunk(self, index: int, piece: ResponsePiece) -> ChatCompletionChunk | None:
        """Choice ``index``'s chunk of ``piece``; None for a tool-call reply's chunk that carries nothing (its text
        not yet a call's: vLLM sends none)."""
        role = "assistant" if self._first_chunk(index, piece) else None
        text = piece.text.decode("utf-8", errors="replace")
        if self.tools is None:
            delta = Delta(role=role, content=(self.echo if role else "") + text)
            reason = piece.finish_reason
        else:
            delta = Delta(role=role, content=self.echo if role and self.echo else None,
                          tool_calls=self.tools.deltas(index, text))
            reason = self.tools.streamed_finish_reason(index, piece.finish_reason)
            if not (role or delta.tool_calls or reason or self.return_token_ids or self.continuous_usage
                    or self.top_logprobs is not None):
                return None
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=self._logprobs(piece.logprobs or []),
                                 finish_reason=reason, stop_reason=piece.stop_reason,
                                 token_ids=self._ids(piece.token_ids))
        extras = {} if index else {"visual_cap": piece.visual_cap, "media": piece.media, "timeline": piece.timeline,
                                   "prompt_token_ids": self._prompt_token_ids(0, piece.input_ids) if role else None}
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice],
                                   usage=self._running_usage(index, piece), **extras)

    def usage_chunk(self, counts: Usage) -> ChatCompletionChunk:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=counts)

    def _logprobs(self, entries: list[dict]) -> ChatLogprobs | None:
        return None if self.top_logprobs is None else chat_logprobs(entries, self.top_logprobs)


class CompletionShape(_Shape):
    """``text_completion`` bodies, whole and streamed. With ``echo`` (the prompts: texts, or token ids, whose text the
    orchestrator's first response brings as ``prompt_text``), each choice's text starts with its prompt's (streamed:
    its first chunk's), and its ``logprobs`` with its prompt tokens' (vLLM's). ``echo_only`` (``echo`` with
    ``max_tokens`` 0, which the orchestrator runs as 1: vLLM's echo without generation): the prompt alone."""

    prefix = "cmpl"

    def __init__(self, model: str, return_token_ids: bool, top_logprobs: int | None = None, n: int = 1,
                 echo: list[str | list[int]] | None = None, echo_only: bool = False, continuous_usage: bool = False, *,
                 request_id: str | None = None):
        super().__init__(model, return_token_ids, top_logprobs, n, continuous_usage, request_id=request_id)
        self.echo = echo
        self.echo_only = echo_only
        self._offsets: dict[int, int] = {}  # each choice's streamed text so far: where its next chunk's text starts

    def whole(self, replies: list[Reply]) -> Completion:
        choices = []
        for index, reply in enumerate(replies):  # a prompt's first choice before its others
            prompt = self._prompt_entries(index, reply)
            text, ids, entries = self._generated(reply.text, reply.token_ids, reply.logprobs)
            choices.append(CompletionChoice(
                index=index, text=self._echoed(index, reply) + text,
                logprobs=self._logprobs(self._echoed_logprobs(prompt) + entries, 0),
                finish_reason=reply.finish_reason, stop_reason=reply.stop_reason, token_ids=self._ids(ids),
                prompt_logprobs=prompt_logprobs(prompt),
                prompt_token_ids=self._prompt_token_ids(index, reply.prompt_ids)))
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices,
                          usage=self._whole_usage(replies), timeline=replies[0].timeline)

    def chunk(self, index: int, piece: ResponsePiece) -> Completion:
        text, ids, entries = self._generated(piece.text.decode("utf-8", errors="replace"), piece.token_ids,
                                             piece.logprobs or [])
        prompt_ids = None
        if self._first_chunk(index, piece):
            prompt = self._prompt_entries(index, piece)  # a prompt's first choice's first piece comes first
            text, entries = self._echoed(index, piece) + text, self._echoed_logprobs(prompt) + entries
            prompt_ids = self._prompt_token_ids(index, piece.input_ids)
        offset = self._offsets.get(index, 0)
        choice = CompletionChoice(index=index, text=text, logprobs=self._logprobs(entries, offset),
                                  finish_reason=piece.finish_reason, stop_reason=piece.stop_reason,
                                  token_ids=self._ids(ids), prompt_token_ids=prompt_ids)
        self._offsets[index] = offset + len(text)  # each chunk's offsets start at its own text, as vLLM anchors them
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice],
                          usage=self._running_usage(index, piece), timeline=None if index else piece.timeline)

    def usage_chunk(self, counts: Usage) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=counts)

    def _generated(self, text: str, ids, entries: list[dict]) -> tuple[str, tuple[int, ...], list[dict]]:
        """The generated part of a reply or chunk (its text, token ids, log probabilities' entries); none when
        ``echo_only``."""
        return ("", (), []) if self.echo_only else (text, tuple(ids), entries)

    def _echoed(self, index: int, reply: Reply | ResponsePiece) -> str:
        """The text choice ``index`` starts with: its prompt's with echo (``reply``'s ``prompt_text`` for token ids)."""
        if not self.echo:
            return ""
        prompt = self.echo[index // self.n]
        return prompt if isinstance(prompt, str) else reply.prompt_text or ""

    def _echoed_logprobs(self, prompt: list[dict] | None) -> list[dict]:
        """The prompt's entries that an echo's ``logprobs`` start with (none without echo)."""
        return (prompt or []) if self.echo else []

    def _logprobs(self, entries: list[dict], offset: int) -> CompletionLogprobs | None:
        return None if self.top_logprobs is None else completion_logprobs(entries, offset, self.top_logprobs)
