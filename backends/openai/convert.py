"""An API request -> the orchestrator's inputs (pure: no I/O; http(s) media are fetched by ``media_fetch``).

A chat goes as the orchestrator's ``messages`` input (``orchestrator.messages``): the same messages with each
``image_url`` / ``video_url`` part replaced by an ``{"type": "image"}`` / ``{"type": "video"}`` placeholder, and
the URLs in ``image_url`` / ``video_url`` in the order of their placeholders, which is how the orchestrator pairs
them. A completion's prompts go as ``prompt``, one request each: completed as they are, without the chat template
(OpenAI's and vLLM's completions). ``backends.openai.choices`` sends a request once per choice.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.grpc import InferInput

from backends.openai.schemas import TEXT_PARTS, ChatCompletionRequest, CompletionRequest, ImageUrlPart


@dataclass(frozen=True)
class MediaRef:
    """One image or video of a chat: ``kind`` "image" | "video", its ``url``, and ``where`` it sits in the request
    (``messages[i].content[j].image_url``), which errors name."""

    kind: str
    url: str
    where: str


@dataclass(frozen=True)
class OrchestratorRequest:
    """One request's orchestrator inputs: ``prompt`` or ``prompt_token_ids`` (a completion) or ``messages`` (JSON, a
    chat); ``media`` in placeholder order; ``sampling`` (``sampling_parameters``); ``stream``; ``return_token_ids``
    (``return_output_ids``); ``return_timeline`` (it asks for the output ids too: the timeline counts the tokens each
    chunk brings, ``backends.openai.timing``; the reply shows them only with ``return_token_ids``);
    ``return_logprobs``: the request asks for log probabilities (``sampling``'s ``logprobs``: the top tokens'
    count, where not 0); ``continuous_usage``: every response brings the prompt's token count and the token ids
    (``stream_options.continuous_usage_stats``: each chunk's usage so far); ``request_id``: the Triton request id to
    send it with (None: a new one); ``choices`` over 1: the request is the first of that many choices, admitted as
    one (``orchestrator.choice_reservations``), which name its ``request_id`` in ``choice_of``; ``structured_as``:
    the field the request sent its ``sampling``'s ``structured_outputs`` as (``response_format``), which errors name;
    ``return_prompt_ids``: the first response brings the prompt's token ids (``return_input_ids``: vLLM's
    ``prompt_token_ids`` with ``return_token_ids``)."""

    prompt: str | None
    messages: str | None
    media: tuple[MediaRef, ...]
    sampling: dict[str, Any]
    stream: bool
    return_token_ids: bool
    return_timeline: bool = False
    return_logprobs: bool = False
    prompt_token_ids: tuple[int, ...] | None = None
    chat_template_kwargs: str | None = None  # JSON (orchestrator.chat_options), a chat's where not the defaults
    continuous_usage: bool = False
    tokenize_only: bool = False  # the prompt's tokens, no reply (the orchestrator's tokenize_only: /tokenize)
    input_tokens: bool = True  # with tokenize_only: the ids' token strings too (the orchestrator's input_tokens)
    request_id: str | None = None
    choices: int = 1
    choice_of: str | None = None
    structured_as: str = "structured_outputs"
    return_prompt_ids: bool = False

    def with_media(self, media: tuple[MediaRef, ...]) -> "OrchestratorRequest":
        return dataclasses.replace(self, media=media)

    def inputs(self, token_channel: str | None = None) -> list[InferInput]:
        """The Triton inputs, with ``token_channel`` where given (``backends.openai.token_channel``). The reply
        comes without the prompt (``exclude_input_in_output``)."""
        tensors: list[tuple[str, np.ndarray]] = [
            ("sampling_parameters", _strings([json.dumps(self.sampling)])),
            ("stream", np.array([self.stream])),
            ("exclude_input_in_output", np.array([True])),
        ]
        if self.prompt is not None:
            tensors.append(("prompt", _strings([self.prompt])))
        if self.messages is not None:
            tensors.append(("messages", _strings([self.messages])))
        if self.chat_template_kwargs is not None:
            tensors.append(("chat_template_kwargs", _strings([self.chat_template_kwargs])))
        if self.prompt_token_ids is not None:
            tensors.append(("prompt_token_ids", np.array(self.prompt_token_ids, dtype=np.int64)))
        for kind in ("image", "video"):
            urls = [m.url for m in self.media if m.kind == kind]
            if urls:
                tensors.append((f"{kind}_url", _strings(urls)))
        if self.return_token_ids or self.return_timeline or self.continuous_usage:
            tensors.append(("return_output_ids", np.array([True])))
        if self.continuous_usage:
            tensors.append(("return_num_input_tokens", np.array([True])))
        if self.return_prompt_ids:
            tensors.append(("return_input_ids", np.array([True])))
        if self.return_timeline:
            tensors.append(("return_timeline", np.array([True])))
        if self.return_logprobs:
            tensors.append(("return_logprobs", np.array([True])))
        if self.tokenize_only:
            tensors.append(("tokenize_only", np.array([True])))
            if not self.input_tokens:
                tensors.append(("return_input_tokens", np.array([False])))
        if token_channel is not None:
            tensors.append(("token_channel", _strings([token_channel])))
        if self.choices > 1:
            tensors.append(("choices", np.array([self.choices], dtype=np.int64)))
        if self.choice_of is not None:
            tensors.append(("choice_of", _strings([self.choice_of])))
        inputs = []
        for name, array in tensors:
            tensor = InferInput(name, list(array.shape), _TRITON_TYPES.get(array.dtype.kind, "BYTES"))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        return inputs


_TRITON_TYPES = {"b": "BOOL", "i": "INT64"}  # numpy dtype kinds; strings are objects: BYTES


def _strings(values: list[str]) -> np.ndarray:
    # surrogatepass: a lone surrogate (a JSON "\\ud800") goes as the bytes it makes, which the orchestrator refuses
    # as not UTF-8 (400), naming its input
    return np.array([v.encode("utf-8", "surrogatepass") for v in values], dtype=np.object_)


def chat_request(request: ChatCompletionRequest) -> OrchestratorRequest:
    """The orchestrator's request for a chat (the module docstring says how); ``developer`` messages go as
    ``system``; a message's fields for the template go with it (``ChatMessage.template_fields``), and the tools in
    ``chat_template_kwargs`` (``ChatCompletionRequest.template_kwargs``)."""
    messages, media = [], []
    for i, message in enumerate(request.messages):
        role = "system" if message.role == "developer" else message.role
        fields = message.template_fields(role)
        if message.content is None or isinstance(message.content, str):  # null: a message without parts
            messages.append({"role": role, "content": message.content, **fields})
            continue
        parts = []
        for j, part in enumerate(message.content):
            if isinstance(part, TEXT_PARTS):
                parts.append({"type": "text", "text": part.text})
                continue
            kind = "image" if isinstance(part, ImageUrlPart) else "video"
            url = part.image_url.url if isinstance(part, ImageUrlPart) else part.video_url.url
            media.append(MediaRef(kind, url, f"messages[{i}].content[{j}].{kind}_url"))
            parts.append({"type": kind})
        messages.append({"role": role, "content": parts, **fields})
    kwargs = request.template_kwargs
    return OrchestratorRequest(None, json.dumps(messages), tuple(media), request.sampling_parameters(),
                               request.stream, request.return_token_ids, request.return_timeline,
                               request.top_logprobs_asked is not None,
                               chat_template_kwargs=None if kwargs is None else json.dumps(kwargs),
                               continuous_usage=request.continuous_usage, structured_as=request.structured_field,
                               return_prompt_ids=request.return_token_ids)


def completion_requests(request: CompletionRequest) -> list[OrchestratorRequest]:
    """The orchestrator's requests for a completion, one per prompt: each as ``prompt`` (a text) or
    ``prompt_token_ids`` (token ids), without the chat template."""
    sampling = request.sampling_parameters()
    return [OrchestratorRequest(prompt if isinstance(prompt, str) else None, None, (), sampling, request.stream,
                                request.return_token_ids, request.return_timeline,
                                request.top_logprobs_asked is not None,
                                None if isinstance(prompt, str) else tuple(prompt),
                                continuous_usage=request.continuous_usage, structured_as=request.structured_field,
                                return_prompt_ids=request.return_token_ids)
            for prompt in request.prompts]
