"""Python API for UnifiedServe's decoupled ``orchestrator`` model over gRPC streaming.

One :meth:`Client.generate` call is one request on a gRPC bidirectional stream
(``tritonclient.grpc``: ``start_stream`` / ``async_stream_infer`` / ``stop_stream``). Responses are
read until the one that carries the ``triton_final_response`` parameter, which Triton adds when the
stream is opened with ``enable_empty_final_response=True``.

Times are wall-clock milliseconds from just before the request is sent: TTFT is the arrival of the
first response with text or token ids, TBT the gaps between consecutive tokens. A response may carry several
tokens (the server sends what has queued up when it is behind); when token ids are returned, such a response of
``k`` tokens counts ``k`` gaps of a ``k``-th of its wait each (the first response's extra tokens count none: no
wait measures them), so the mean TBT is per token; without ids each response counts as one token.

The response pieces (``client.pieces``) and the timing (:class:`_Collector`) are shared with
``client.http_stream``, so both transports report the same :class:`GenerationResult`.
"""
from __future__ import annotations

import codecs
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.pieces import ResponsePiece, piece_from_grpc

DEFAULT_MODEL = "orchestrator"
DEFAULT_GRPC_URL = "127.0.0.1:8001"
CANCELLED = "cancelled"  # finish_reason when the client stopped the stream itself


class ServerError(RuntimeError):
    """The server (or the transport to it) answered with an error; ``str(e)`` is its message."""


@dataclass
class GenerationResult:
    """One finished (or client-cancelled) generation.

    ``num_output_tokens`` is the server's count (the last value it sent); when the server sends none,
    ``len(token_ids)`` if ids were returned, else ``None``. ``finish_reason`` is the server's
    ("stop", "length", "abort"), ``"cancelled"`` when the client cancelled, ``None`` if never sent.
    ``visual_cap``: what the server's ``max_visual_tokens`` changed in the request's media (its ``visual_cap``
    output: ``max_visual_tokens``, ``requested_visual_tokens``, ``visual_tokens``, ``fps``, ``max_pixels``), or
    None when nothing was. ``media``: what the server did with each image and video, in the prompt's order (its
    ``media`` output, docs/requests.md: ``kind``, ``grid_thw``, ``visual_tokens``, ``width``, ``height``; a
    video's ``frames_in_file``, ``duration_s``, ``frames`` used, ``sampled_frames``, ``fps``), None without media.
    ``timeline``: the server's record of where the request's time went (``return_timeline``;
    ``{"arrived_monotonic_s": ..., "events": [{"ms": ..., "event": ..., ...}], "tokens": {...}}``, docs/requests.md,
    orchestrator/timeline.py), else None.
    ``num_cached_tokens``: of the prompt's tokens, those the server found in its prefix cache (not computed again).
    ``logprobs``: with ``return_logprobs``, one entry per output token, ``{"<token id>": {"logprob", "rank",
    "decoded_token"}}``, the sampled token first, then ``sampling``'s ``logprobs`` top tokens (docs/requests.md),
    else empty; ``cumulative_logprob``: the output's summed log probability (natural log), with it, else None.
    ``prompt_logprobs``: with ``sampling``'s ``prompt_logprobs``, one entry per prompt token as ``logprobs``' (the
    first token's ``logprob`` and ``rank`` None: it follows nothing; docs/requests.md), else None.
    ``stop_reason``: the stop string, or the stop token's id, that ended the output (vLLM's: None when it ended with
    the tokenizer's eos token, for another reason, or the server sent none).
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    num_cached_tokens: int | None = None
    finish_reason: str | None = None
    ttft_ms: float | None = None
    tbt_ms: list[float] = field(default_factory=list)
    num_responses: int = 0  # responses that carried text or token ids
    visual_cap: dict | None = None
    media: list[dict] | None = None
    timeline: dict | None = None
    logprobs: list[dict] = field(default_factory=list)
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict] | None = None
    stop_reason: int | str | None = None

    @property
    def mean_tbt_ms(self) -> float | None:
        """Mean gap between consecutive tokens (ms, as the module docstring counts them); ``None`` with fewer
        than two."""
        return sum(self.tbt_ms) / len(self.tbt_ms) if self.tbt_ms else None


class _Collector:
    """Accumulates pieces into a :class:`GenerationResult`; ``t0`` and arrival times in seconds."""

    def __init__(self, t0: float, on_text: Callable[[str], None] | None = None):
        self.t0 = t0
        self.on_text = on_text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text: list[str] = []
        self._last: float | None = None
        self.result = GenerationResult()

    def add(self, t: float, piece: ResponsePiece) -> None:
        r = self.result
        if piece.text:
            # A delta may end inside a multi-byte character; the decoder keeps the tail for the next.
            s = self._decoder.decode(piece.text)
            if s:
                self._text.append(s)
                if self.on_text is not None:
                    self.on_text(s)
        r.token_ids.extend(piece.token_ids)
        if piece.num_input_tokens is not None:
            r.num_input_tokens = piece.num_input_tokens
        if piece.num_output_tokens is not None:
            r.num_output_tokens = piece.num_output_tokens
        if piece.num_cached_tokens is not None:
            r.num_cached_tokens = piece.num_cached_tokens
        if piece.finish_reason is not None:
            r.finish_reason = piece.finish_reason
        if piece.visual_cap is not None:
            r.visual_cap = piece.visual_cap
        if piece.media is not None:
            r.media = piece.media
        if piece.timeline is not None:
            r.timeline = piece.timeline
        r.logprobs += piece.logprobs or ()
        if piece.cumulative_logprob is not None:
            r.cumulative_logprob = piece.cumulative_logprob
        if piece.prompt_logprobs is not None:
            r.prompt_logprobs = piece.prompt_logprobs
        if piece.stop_reason is not None:
            r.stop_reason = piece.stop_reason
        if piece.has_output:
            r.num_responses += 1
            k = max(1, len(piece.token_ids))
            if self._last is None:
                r.ttft_ms = (t - self.t0) * 1e3
            else:
                r.tbt_ms += [(t - self._last) * 1e3 / k] * k
            self._last = t

    def finish(self, cancelled: bool = False) -> GenerationResult:
        tail = self._decoder.decode(b"", final=True)
        if tail:
            self._text.append(tail)
            if self.on_text is not None:
                self.on_text(tail)
        r = self.result
        r.text = "".join(self._text)
        if r.num_output_tokens is None and r.token_ids:
            r.num_output_tokens = len(r.token_ids)
        if cancelled:
            r.finish_reason = CANCELLED
        return r


def _as_list(x: bytes | str | Sequence | None) -> list:
    if x is None:
        return []
    if isinstance(x, (bytes, bytearray, str)):
        return [x]
    return list(x)


def _bytes_tensor(items: list) -> np.ndarray:
    """1-D object array of ``bytes`` (str items are UTF-8 encoded), as Triton's BYTES wants."""
    out = np.empty(len(items), dtype=object)
    for i, x in enumerate(items):
        if isinstance(x, str):
            x = x.encode()
        elif not isinstance(x, (bytes, bytearray)):
            raise TypeError(f"expected bytes or str, got {type(x).__name__}")
        out[i] = bytes(x)
    return out


def request_tensors(
    text: str,
    *,
    video: bytes | None = None,
    image: bytes | Sequence[bytes] | None = None,
    video_url: str | Sequence[str] | None = None,
    image_url: str | Sequence[str] | None = None,
    sampling: dict | None = None,
    stream: bool = True,
    return_output_ids: bool = False,
    exclude_input_in_output: bool | None = None,
    return_timeline: bool = False,
    return_logprobs: bool = False,
) -> list[tuple[str, np.ndarray, str]]:
    """The request's input tensors as ``(name, array, triton_dtype)``.

    ``text_input`` BYTES [1], ``sampling_parameters`` BYTES [1] (JSON; ``{}`` when None),
    ``stream`` BOOL [1]; media only when given: ``video`` BYTES [1] (the file's bytes), ``image``
    BYTES [n], ``video_url`` / ``image_url`` BYTES [n]; ``return_output_ids`` BOOL [1] only when
    True, so servers without that optional input still accept the request; ``exclude_input_in_output``
    BOOL [1] only when True, which it is by default (None) without streaming: the server follows the vLLM
    backend, whose non-streamed text starts with the prompt unless asked not to, and this client returns the
    reply alone either way; ``return_timeline`` BOOL [1] only when True; ``return_logprobs`` True: both
    ``return_logprobs`` and ``return_cumulative_logprob`` BOOL [1] (the top tokens' count: ``sampling``'s
    ``logprobs``).
    Raises TypeError for a non-str ``text`` or non-bytes media.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    tensors = [
        ("text_input", _bytes_tensor([text]), "BYTES"),
        ("sampling_parameters", _bytes_tensor([json.dumps(sampling or {})]), "BYTES"),
        ("stream", np.array([bool(stream)], dtype=bool), "BOOL"),
    ]
    if video is not None:
        if not isinstance(video, (bytes, bytearray)):
            raise TypeError("video must be the file's bytes; use video_url for a path")
        tensors.append(("video", _bytes_tensor([video]), "BYTES"))
    for name, value in (("image", image), ("video_url", video_url), ("image_url", image_url)):
        items = _as_list(value)
        if name == "image" and any(isinstance(x, str) for x in items):
            raise TypeError("image must be the files' bytes; use image_url for paths")
        if items:
            tensors.append((name, _bytes_tensor(items), "BYTES"))
    for name, flag in (("return_output_ids", return_output_ids), ("return_timeline", return_timeline),
                       ("return_logprobs", return_logprobs), ("return_cumulative_logprob", return_logprobs)):
        if flag:
            tensors.append((name, np.array([True], dtype=bool), "BOOL"))
    if (not stream) if exclude_input_in_output is None else exclude_input_in_output:
        tensors.append(("exclude_input_in_output", np.array([True], dtype=bool), "BOOL"))
    return tensors


def grpc_inputs(tensors: list[tuple[str, np.ndarray, str]]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array, dtype in tensors:
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        inputs.append(t)
    return inputs


def _error_message(e: BaseException) -> str:
    msg = e.message() if isinstance(e, InferenceServerException) else str(e)
    return msg or repr(e)


class Client:
    """gRPC client of one model; one request at a time (calls are serialized by a lock).

    For concurrent requests use one ``Client`` per thread: each holds one gRPC channel and one stream.
    """

    def __init__(self, url: str = DEFAULT_GRPC_URL, model: str = DEFAULT_MODEL):
        self.url = url
        self.model = model
        self._grpc = grpcclient.InferenceServerClient(url)
        self._lock = threading.Lock()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Returns once the server and the model report ready; raises TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._grpc.is_server_ready() and self._grpc.is_model_ready(self.model):
                    return
            except InferenceServerException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.model} at {self.url} not ready within {timeout_s} s")
            time.sleep(0.5)

    def generate(
        self,
        text: str,
        *,
        video: bytes | None = None,
        image: bytes | Sequence[bytes] | None = None,
        video_url: str | Sequence[str] | None = None,
        image_url: str | Sequence[str] | None = None,
        sampling: dict | None = None,
        stream: bool = True,
        return_output_ids: bool = False,
        on_text: Callable[[str], None] | None = None,
        timeout_s: float = 600.0,
        request_id: str | None = None,
        cancel_after_responses: int | None = None,
        exclude_input_in_output: bool | None = None,
        return_timeline: bool = False,
        return_logprobs: bool = False,
    ) -> GenerationResult:
        """Sends one request and collects its responses (``exclude_input_in_output``, ``return_logprobs``: see
        :func:`request_tensors`; by default the text is the reply alone, streamed or not).

        ``on_text`` is called with each decoded text delta as it arrives. With
        ``cancel_after_responses=N`` the stream is stopped with ``cancel_requests=True`` after N
        responses with text or token ids, and the partial result has ``finish_reason="cancelled"``.
        Raises ServerError with the server's message on an error response (or a transport error),
        TimeoutError when no final response comes within ``timeout_s`` seconds (the request is then
        cancelled), TypeError for bad argument types.
        """
        inputs = grpc_inputs(request_tensors(
            text, video=video, image=image, video_url=video_url, image_url=image_url,
            sampling=sampling, stream=stream, return_output_ids=return_output_ids,
            exclude_input_in_output=exclude_input_in_output, return_timeline=return_timeline,
            return_logprobs=return_logprobs))
        responses: queue.Queue = queue.Queue()
        with self._lock:
            self._grpc.start_stream(callback=lambda result, error: responses.put((result, error)))
            cancel = True  # unless the final response arrives, leave nothing running on the server
            try:
                t0 = time.perf_counter()
                self._grpc.async_stream_infer(self.model, inputs, request_id=request_id or "",
                                              enable_empty_final_response=True)
                collector = _Collector(t0, on_text)
                deadline = t0 + timeout_s
                while True:
                    if cancel_after_responses is not None and collector.result.num_responses >= cancel_after_responses:
                        return collector.finish(cancelled=True)
                    try:
                        result, error = responses.get(timeout=max(deadline - time.perf_counter(), 0.0))
                    except queue.Empty:
                        raise TimeoutError(f"no final response from {self.model} within {timeout_s} s") from None
                    arrived = time.perf_counter()
                    if error is not None:
                        # The orchestrator sends every error with the final flag, so the request is over: the
                        # stream closes without cancelling it. (A cancellation of a request that Triton 2.51 has
                        # just finished can leave its gRPC frontend waiting for a callback that never comes, and
                        # the model then cannot unload until the server's exit timeout.)
                        cancel = False
                        raise ServerError(_error_message(error))
                    piece = piece_from_grpc(result)
                    collector.add(arrived, piece)
                    if piece.final:
                        cancel = False
                        return collector.finish()
            except InferenceServerException as e:
                # A broken stream (e.g. nothing listens at url) is reported to the callback; its
                # message says what happened, the exception raised here only that the stream broke.
                try:
                    _, error = responses.get(timeout=1.0)
                except queue.Empty:
                    error = None
                raise ServerError(_error_message(error if error is not None else e)) from e
            finally:
                self._grpc.stop_stream(cancel_requests=cancel)

    def close(self) -> None:
        self._grpc.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
