"""One response of the ``orchestrator`` model as its clients read it (:class:`ResponsePiece`): from a streamed gRPC
response (:func:`piece_from_grpc`) here, from an HTTP generate_stream event in ``client.http_stream``; its JSON
outputs read by :func:`json_output`."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Callable, Iterable

import tritonclient.grpc as grpcclient


@dataclass(frozen=True)
class ResponsePiece:
    """What one response carried; absent outputs are ``None`` (``text`` is raw UTF-8 bytes)."""

    text: bytes = b""
    token_ids: tuple[int, ...] = ()
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    num_cached_tokens: int | None = None
    finish_reason: str | None = None
    final: bool = False
    visual_cap: dict | None = None
    media: list[dict] | None = None
    timeline: dict | None = None
    logprobs: list[dict] | None = None  # return_logprobs: an entry per token (docs/requests.md)
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict] | None = None  # sampling's prompt_logprobs: first response only
    prompt_text: str | None = None  # a prompt_token_ids request's prompt as text: first response only
    stop_reason: int | str | None = None  # last response: the stop string or stop token id that ended the output
    input_ids: tuple[int, ...] | None = None  # the prompt's ids: tokenize_only's response, return_input_ids' first
    input_tokens: tuple[str, ...] | None = None  # and each one's token string

    @property
    def has_output(self) -> bool:
        """Whether it brought output tokens: text or ids, or, before the last response, always (the orchestrator
        sends one only for tokens, whose text may be held back: part of a character, a possible stop string, a
        special token's empty text; their ids come only with return_output_ids)."""
        return bool(self.text) or bool(self.token_ids) or (not self.final and self.finish_reason is None)


def _scalar(result: grpcclient.InferResult, name: str):
    a = result.as_numpy(name)
    return None if a is None or a.size == 0 else a.reshape(-1)[0]


def json_output(value: str | bytes | None):
    """A JSON output's value (``visual_cap``, ``media``, ``timeline``, ``logprobs``, ``prompt_logprobs``,
    ``prompt_text``, ``stop_reason``) read, or None where it is absent or empty: an array written one element a line
    (the orchestrator's ``prompt_logprobs``) element by element (:func:`json_entries`).
    Raises json.JSONDecodeError (a ValueError) when it is not JSON."""
    if value is None or len(value) == 0:
        return None
    text = value.decode("utf-8") if isinstance(value, bytes) else value
    return json_entries(text) if text.startswith("[\n") else json.loads(text)


def json_entries(text: str) -> list:
    """A JSON array written ``"[\\n" + ",\\n".join(elements) + "\\n]"``, each element on a line of its own (a line
    break inside a JSON string is always escaped, so every one here is a separator), read element by element: many
    small parses, between which a thread can yield the GIL, where one ``json.loads`` of a 30 MB array (a 16,000-token
    prompt's log probabilities at 20 top tokens) holds it for about 300 ms and stalls every other thread of the
    process. Raises json.JSONDecodeError (a ValueError) for another layout."""
    if not text.endswith("\n]"):
        raise json.JSONDecodeError("not an array written one element a line", text, 0)
    body = text[2:-2]
    return [json.loads(element) for element in body.split(",\n")] if body else []


LARGE_RESPONSE_BYTES = 1 << 20  # a response whose outputs hold more is read off an event loop (response_bytes)


def response_bytes(result: grpcclient.InferResult) -> int:
    """The bytes of a gRPC response's outputs. Reading one (its JSON outputs parsed: 92 ms for the 7 MB of a
    4,096-token prompt's log probabilities with 20 top tokens each) holds the GIL throughout, so an asyncio client
    reads one of more than ``LARGE_RESPONSE_BYTES`` in a worker thread."""
    return sum(len(content) for content in result.get_response().raw_output_contents)


def is_final(result: grpcclient.InferResult) -> bool:
    """Whether a streamed gRPC response is its request's last (Triton's ``triton_final_response`` parameter)."""
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def piece_from_grpc(result: grpcclient.InferResult) -> ResponsePiece:
    """Reads one streamed gRPC response (any subset of the orchestrator's outputs may be present)."""
    text = result.as_numpy("text_output")
    ids = result.as_numpy("output_ids")
    piece = piece_from_outputs(
        b"".join(x if isinstance(x, bytes) else str(x).encode() for x in text.reshape(-1)) if text is not None else b"",
        tuple(int(i) for i in ids.reshape(-1)) if ids is not None else (), is_final(result),
        lambda name: _scalar(result, name))
    prompt_ids, tokens = result.as_numpy("input_ids"), result.as_numpy("input_tokens")
    return with_prompt(piece, None if prompt_ids is None else prompt_ids.reshape(-1),
                       None if tokens is None else tokens.reshape(-1))


def with_prompt(piece: ResponsePiece, prompt_ids: Iterable | None, tokens: Iterable | None = None) -> ResponsePiece:
    """``piece`` with the prompt's ``input_ids`` (a ``tokenize_only`` response's, or ``return_input_ids``' first
    response's) and their ``input_tokens`` (UTF-8 bytes or text) where the response brought them, as either
    transport reads them (``client.http_stream`` reads events); ``piece`` itself without ids."""
    if prompt_ids is None:
        return piece
    # a NumPy array's own tolist: a 3-minute video's 107,002 ids in 2.5 ms against 9 element by element
    ids = tuple(prompt_ids.tolist()) if hasattr(prompt_ids, "tolist") else tuple(map(int, prompt_ids))
    return dataclasses.replace(piece, input_ids=ids, input_tokens=None if tokens is None
                               else tuple(t.decode("utf-8", "replace") if isinstance(t, bytes) else t for t in tokens))


_JSON_OUTPUTS = ("visual_cap", "media", "timeline", "logprobs", "prompt_logprobs", "prompt_text", "stop_reason")


def piece_from_outputs(text: bytes, token_ids: tuple[int, ...], final: bool, value: Callable[[str], object]
                       ) -> ResponsePiece:
    """A piece of ``text`` (UTF-8), ``token_ids`` and ``final``, its other outputs read by ``value(name)`` (the
    output's one value, None where absent): either transport's response (``client.http_stream`` reads events)."""
    n_in, n_out, n_cached, reason, cumulative = (value(name) for name in (
        "num_input_tokens", "num_output_tokens", "num_cached_tokens", "finish_reason", "cumulative_logprob"))
    if isinstance(reason, bytes):
        reason = reason.decode()
    return ResponsePiece(
        text=text, token_ids=token_ids,
        num_input_tokens=None if n_in is None else int(n_in),
        num_output_tokens=None if n_out is None else int(n_out),
        num_cached_tokens=None if n_cached is None else int(n_cached),
        finish_reason=None if reason in (None, "") else str(reason),
        final=final,
        cumulative_logprob=None if cumulative is None else float(cumulative),
        **{name: json_output(value(name)) for name in _JSON_OUTPUTS})
