"""Client inputs -> a validated request (no Triton, no torch: testable on its own).

Names follow the vLLM backend's (Triton's vllm_backend ``model.json``), so its clients work unchanged: ``text_input``
(one user turn; or ``messages``, a whole conversation: ``orchestrator.messages``; or ``prompt``, text completed as
it is, without the chat template, as the vLLM backend's ``text_input`` and OpenAI's completions are; or
``prompt_token_ids``, such a prompt as token ids), ``image`` (file bytes, or the file base64-encoded as that backend
takes it), ``video`` (file bytes), ``image_url``/``video_url`` (a path or ``file://`` URL under an allowed folder, or
a ``data:`` URL), ``sampling_parameters`` (JSON; without it, the request's own parameters:
``orchestrator.request_parameters``), ``stream``, ``exclude_input_in_output``, ``return_output_ids``, and that
backend's ``return_*`` flags (``return_logprobs`` with ``sampling_parameters``' ``logprobs``, and
``return_cumulative_logprob``), plus our ``return_timeline`` (``orchestrator.timeline``), ``return_input_ids`` and
``chat_template_kwargs`` (``orchestrator.chat_options``). Every problem raises
:class:`~orchestrator.sampling_params.InvalidInput` naming the input at fault.
"""
from __future__ import annotations

import base64
import binascii
import functools
import os
import re
import stat
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping

from backends.triton.triton_io import int_parameter
from flashcodec.files import FileStamp, file_stamp
from orchestrator import request_parameters
from orchestrator.chat_options import ChatOptions, parse_chat_options
from orchestrator.messages import Turn, media_kinds, parse_messages, user_turn
from orchestrator.sampling_params import InvalidInput, RequestParams, parse_sampling_parameters

MAX_NAME_BYTES = 256  # a token channel's name, a request id in choice_of


@dataclass(frozen=True)
class MediaInput:
    """One image or video: file bytes, or a checked path (``path``, ``data`` empty; ``stamp``: the file's
    ``flashcodec.files.file_stamp`` then, checked again by its decode). ``input``: its input, which errors name."""

    kind: str  # "image" | "video"
    data: bytes = b""
    path: str | None = None
    input: str = ""
    position: str = ""  # "item K of N" in a request of several media items (prompt order), else ""
    stamp: FileStamp | None = None

    @property
    def input_name(self) -> str:
        """What errors name it: its input, and its place among several items, e.g. ``image_url (item 2 of 3)``."""
        name = self.input or self.kind
        return f"{name} ({self.position})" if self.position else name

    @property
    def source(self) -> bytes | str:
        return self.path if self.path is not None else self.data


@dataclass(frozen=True)
class RawRequest:
    """The request's tensors as Python values (what backends/triton/triton_io.py reads)."""

    text_input: list[bytes]
    image: list[bytes] = field(default_factory=list)
    video: list[bytes] = field(default_factory=list)
    image_url: list[bytes] = field(default_factory=list)
    video_url: list[bytes] = field(default_factory=list)
    sampling_parameters: list[bytes] = field(default_factory=list)
    stream: bool = False
    exclude_input_in_output: bool = False
    return_output_ids: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_logprobs: bool = False
    return_cumulative_logprob: bool = False
    messages: list[bytes] = field(default_factory=list)
    prompt: list[bytes] = field(default_factory=list)
    return_timeline: bool = False
    return_input_ids: bool = False  # the first response's input_ids (orchestrator.frontend)
    prompt_token_ids: list[int] | None = None  # a prompt given as token ids (None: not given)
    open_token_channel: list[bytes] = field(default_factory=list)  # orchestrator.token_channels
    token_channel: list[bytes] = field(default_factory=list)
    chat_template_kwargs: list[bytes] = field(default_factory=list)  # orchestrator.chat_options
    tokenize_only: bool = False  # the prompt's tokens, no reply (orchestrator.frontend)
    return_input_tokens: bool = True  # a tokenize_only response's input_tokens (False: left out)
    choices: list[int] | None = None  # a request's choices admitted as one (orchestrator.choice_reservations)
    choice_of: list[bytes] = field(default_factory=list)
    parameters: str = ""  # the sampling keys of the request's Triton parameters, JSON (orchestrator.request_parameters)


@dataclass(frozen=True)
class ExtraOutputs:
    """The vLLM backend's additional outputs a request asked for (its ``return_*`` flags, its meaning: every
    response carries each output asked for; ``num_output_tokens`` counts the tokens of that response)."""

    finish_reason: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    timeline: bool = False  # ours, not the vLLM backend's: the final response's ``timeline`` (orchestrator.timeline)
    logprobs: bool = False  # each token's log probabilities (orchestrator.output_processor.Piece)
    cumulative_logprob: bool = False
    input_ids: bool = False  # ours: the first response's ``input_ids``, the prompt as it runs


@dataclass(frozen=True)
class ParsedRequest:
    """``text``: ``text_input`` or ``prompt`` ("" for a ``messages`` request: the text a non-streamed reply is
    prefixed with unless ``exclude_input_in_output``); ``turns``: the conversation the prompt is made of (none for a
    ``prompt`` request, ``raw`` True: ``text`` is the whole prompt, no chat template); ``media`` in the order of
    its placeholders (for ``text_input``: images, then videos); ``token_ids``: a ``prompt_token_ids`` request's
    prompt (``raw`` True, ``text`` empty until the prompt is built: ``Admitted.prompt_text``); ``chat``: how the chat
    template is applied to ``turns`` (``chat_template_kwargs``)."""

    text: str
    media: tuple[MediaInput, ...]
    params: RequestParams
    stream: bool
    exclude_input_in_output: bool
    return_output_ids: bool
    turns: tuple[Turn, ...]
    extra_outputs: ExtraOutputs = ExtraOutputs()
    raw: bool = False
    token_ids: tuple[int, ...] | None = None
    chat: ChatOptions = ChatOptions()


@dataclass(frozen=True)
class InputLimits:
    """``allowed_media_dirs``: folders that ``*_url`` paths may name; ``max_media_bytes`` per item;
    ``max_prompt_bytes`` for ``text_input``; ``max_image_pixels``: the most pixels an image may have (its header
    says, before any decode): the model sees at most 12.8 MP (Qwen2.5-VL's max_pixels) anyway, and a 100 MP image
    costs seconds of CPU and GBs of memory to decode; 50 MP admits phone cameras' 48 MP. ``max_media_items``: images
    and videos per request. ``max_visual_tokens``: a request's visual tokens, met by lowering its videos' fps and then
    its items' pixels (``orchestrator.visual_cap``) instead of refusing it; 0: no cap."""

    allowed_media_dirs: tuple[Path, ...] = ()
    max_media_bytes: int = 512 * 1024 * 1024
    max_prompt_bytes: int = 1024 * 1024  # text_input; tokenizing tens of MB would stall every request
    max_image_pixels: int = 50_000_000
    max_media_items: int = 64
    max_visual_tokens: int = 0

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "InputLimits":
        """From the orchestrator's model parameters plus the ``UNIFIEDSERVE_MEDIA_DIRS`` environment variable
        (both comma- or colon-separated). Raises ValueError naming a parameter that is not a positive integer."""
        names = [*params.get("allowed_media_dirs", "").replace(":", ",").split(","),
                 *os.environ.get("UNIFIEDSERVE_MEDIA_DIRS", "").replace(":", ",").split(",")]
        dirs = tuple(Path(n).resolve() for n in names if n.strip())
        cap = int_parameter(params, "max_visual_tokens", cls.max_visual_tokens)
        if cap < 0:
            raise ValueError(f"parameter max_visual_tokens must be 0 (no cap) or a positive integer, got {cap}")
        return cls(dirs, int_parameter(params, "max_media_bytes", cls.max_media_bytes),
                   int_parameter(params, "max_prompt_bytes", cls.max_prompt_bytes),
                   int_parameter(params, "max_image_pixels", cls.max_image_pixels),
                   int_parameter(params, "max_media_items", cls.max_media_items), cap)


def _resolve_url(kind: str, url: str, limits: InputLimits) -> MediaInput:
    name = f"{kind}_url"
    if not url.strip():
        raise InvalidInput(f"{name}: empty URL (give a path under an allowed folder, a file:// or a data: URL)")
    # Schemes and the base64 marker are case-insensitive (RFC 3986 3.1, RFC 2397 3).
    if url[:5].lower() == "data:":
        header, comma, payload = url.partition(",")
        if not comma:
            raise InvalidInput(f"{name}: a data: URL without the ',' before its data (RFC 2397: "
                               "data:[<media type>];base64,<data>)")
        if ";base64" not in header.lower():
            raise InvalidInput(f"{name}: only base64 data: URLs are supported")
        try:
            data = _unwrapped_base64(payload)
        except (binascii.Error, ValueError) as exc:
            raise InvalidInput(f"{name}: invalid base64 in data: URL ({exc})") from None
        return _checked_bytes(kind, data, limits, name)
    try:
        parsed = urllib.parse.urlparse(url)
    except ValueError as exc:  # a bracketed host that is no IPv6 address ("file://[x")
        raise InvalidInput(f"{name}: not a valid URL ({exc})") from None
    if parsed.scheme in ("http", "https"):
        raise InvalidInput(f"{name}: http(s) URLs are not fetched by this server; send the bytes in '{kind}', "
                           "a data: URL, or a path under an allowed folder")
    if parsed.scheme not in ("", "file"):
        raise InvalidInput(f"{name}: unsupported URL scheme {parsed.scheme!r}")
    if parsed.scheme == "file" and parsed.netloc.lower() not in ("", "localhost"):  # RFC 8089 2: host, else local
        raise InvalidInput(f"{name}: a file URL on host {parsed.netloc[:100]!r} is not on this machine; write "
                           "file:///path (or file://localhost/path)")
    try:
        path = Path(urllib.parse.unquote(parsed.path) if parsed.scheme == "file" else url).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # symlink loops, NUL bytes, over-long names
        raise InvalidInput(f"{name}: not a usable path ({type(exc).__name__})") from None
    if not any(path.is_relative_to(d) for d in limits.allowed_media_dirs):
        raise InvalidInput(f"{name}: {url!r} is outside the allowed media folders "
                           f"({', '.join(map(str, limits.allowed_media_dirs)) or 'none configured'})")
    try:
        status = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise InvalidInput(f"{name}: no such file: {url[:200]!r}") from None
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"{name}: not a usable path ({type(exc).__name__})") from None
    if not stat.S_ISREG(status.st_mode):
        raise InvalidInput(f"{name}: not a regular file (a folder, device or pipe): {url[:200]!r}")
    if not status.st_size:
        raise InvalidInput(f"{name}: empty file (0 bytes): {url[:200]!r}")
    if status.st_size > limits.max_media_bytes:
        raise InvalidInput(f"{name}: file is {status.st_size} bytes, over the limit of {limits.max_media_bytes}")
    return MediaInput(kind, path=str(path), input=name, stamp=file_stamp(status))


# File bytes never start with 4 KiB of base64 alphabet (every image and video container has binary header bytes).
_BASE64_TEXT = re.compile(rb"[A-Za-z0-9+/=\s]+")


def _checked_bytes(kind: str, data: bytes, limits: InputLimits, name: str) -> MediaInput:
    if not data:
        raise InvalidInput(f"{name}: empty {kind} data")
    if name == kind and data[:5].lower() == b"data:":
        raise InvalidInput(f"{name}: got a data: URL; put it in '{kind}_url'")
    if name == "image" and _BASE64_TEXT.fullmatch(data[:4096]):
        data = _base64_image(data)
    elif name == kind and _BASE64_TEXT.fullmatch(data[:4096]):
        raise InvalidInput(f"{name}: got text (its first bytes letters, digits and spaces only), not a {kind} file's "
                           f"bytes; base64 goes in a data: URL in '{kind}_url'")
    if len(data) > limits.max_media_bytes:
        raise InvalidInput(f"{name}: {len(data)} bytes, over the limit of {limits.max_media_bytes}")
    return MediaInput(kind, data=data, input=name)


def _unwrapped_base64(text: str | bytes) -> bytes:
    """Base64 ``text`` decoded, its whitespace skipped (line breaks every 76 characters: MIME's, ``base64`` tools'
    default). Raises binascii.Error for another character outside the alphabet (ValueError for non-ASCII text)."""
    return base64.b64decode(text[:0].join(text.split()), validate=True)


def _base64_image(text: bytes) -> bytes:
    """The vLLM backend's ``image`` input: the image file base64-encoded (line breaks allowed). Raises InvalidInput."""
    try:
        data = _unwrapped_base64(text)
    except binascii.Error as exc:
        raise InvalidInput(f"image: neither an image file (JPEG, PNG, WebP, ...) nor valid base64 text ({exc}); send "
                           "the file's bytes or its base64 encoding") from None
    if not data:
        raise InvalidInput("image: empty image data")
    return data


def one_name(values: list[bytes], input_name: str, what: str) -> str:
    """The one name a STRING input such as ``token_channel`` holds ("" when absent), ``what`` it is called in errors
    (``"channel name"``). Raises InvalidInput naming ``input_name`` for more than one value, an empty name or one over
    ``MAX_NAME_BYTES``, or one not UTF-8."""
    if not values:
        return ""
    if len(values) > 1:
        raise InvalidInput(f"{input_name}: expected one {what}, got {len(values)}")
    if not values[0] or len(values[0]) > MAX_NAME_BYTES:
        raise InvalidInput(f"{input_name}: a {what} is 1 to {MAX_NAME_BYTES} bytes, got {len(values[0])}")
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"{input_name}: not valid UTF-8") from None


def builds_a_grammar(raw: RawRequest) -> bool:
    """Whether :func:`parse_request` will check a structured output (xgrammar compiles it, for up to a second, with
    the GIL released): the orchestrator parses such a request on a thread, not on its event loop."""
    return any(b"structured_outputs" in text or b"guided_decoding" in text
               for text in (*raw.sampling_parameters, raw.parameters.encode()))


def parse_request(raw: RawRequest, limits: InputLimits,
                  sampling_defaults: Mapping[str, object] = MappingProxyType({})) -> ParsedRequest:
    """Validate a request; ``sampling_defaults`` stand for the sampling keys it does not send (the checkpoint's:
    ``orchestrator.generation_defaults``). Raises InvalidInput naming the input at fault."""
    ids = raw.prompt_token_ids
    if sum(map(bool, (raw.text_input, raw.messages, raw.prompt, ids is not None))) > 1:
        raise InvalidInput("text_input, messages, prompt, prompt_token_ids: send exactly one of them")
    turns = _conversation(raw, limits) if raw.messages else None
    if turns or ids is not None:
        text = ""
    else:
        text = _one_text("prompt" if raw.prompt else "text_input", raw.prompt or raw.text_input, limits)
    if len(raw.sampling_parameters) > 1:
        raise InvalidInput("sampling_parameters: expected one JSON string")
    try:
        sampling_text = raw.sampling_parameters[0].decode("utf-8") if raw.sampling_parameters else None
    except UnicodeDecodeError:
        raise InvalidInput("sampling_parameters: not valid UTF-8") from None
    from_parameters, sampling_text = request_parameters.chosen(sampling_text, raw.parameters)
    try:
        params = parse_sampling_parameters(sampling_text, defaults=sampling_defaults)
    except InvalidInput as exc:
        raise (request_parameters.renamed(exc) if from_parameters else exc) from None
    params = replace(params, logprobs=_logprobs_asked(raw, params.logprobs))
    count = sum(map(len, (raw.image, raw.image_url, raw.video, raw.video_url)))
    if count > limits.max_media_items:  # before any is decoded or read
        raise InvalidInput(f"image and video inputs: {count} media items, over the limit of "
                           f"{limits.max_media_items} per request (parameter max_media_items)")
    given: list[tuple[str, Callable[[], MediaInput]]] = []  # (kind, its check), inputs image, image_url, video, ...
    for kind, blobs, urls in (("image", raw.image, raw.image_url), ("video", raw.video, raw.video_url)):
        given += [(kind, functools.partial(_checked_bytes, kind, b, limits, kind)) for b in blobs]
        given += [(kind, functools.partial(_url_input, kind, u, limits)) for u in urls]
    chat = parse_chat_options(raw.chat_template_kwargs)
    if raw.prompt or ids is not None:
        name = "prompt" if raw.prompt else "prompt_token_ids"
        if given:
            raise InvalidInput(f"{name}: a prompt without the chat template takes no images or videos (send them "
                               "with text_input or messages)")
        if raw.chat_template_kwargs:
            raise InvalidInput(f"chat_template_kwargs: {name} is completed without the chat template (send "
                               "text_input or messages)")
        turns = ()
    elif turns:
        order = _placeholder_order(turns, [kind for kind, _ in given])
        given = [given[k] for k in order]
    else:
        turns = (user_turn(text, [kind for kind, _ in given]),)
    chat.check(turns)
    positions = [f"item {k} of {len(given)}" if len(given) > 1 else "" for k in range(1, len(given) + 1)]
    media = [_placed(check, position) for (_, check), position in zip(given, positions)]
    return ParsedRequest(text, tuple(media), params, raw.stream, raw.exclude_input_in_output, raw.return_output_ids,
                         turns, ExtraOutputs(raw.return_finish_reason, raw.return_num_input_tokens,
                                             raw.return_num_output_tokens, raw.return_timeline, raw.return_logprobs,
                                             raw.return_cumulative_logprob, raw.return_input_ids),
                         raw=bool(raw.prompt) or ids is not None,
                         token_ids=None if ids is None else tuple(ids), chat=chat)


def _logprobs_asked(raw: RawRequest, top: int | None) -> int | None:
    """How many top tokens' log probabilities the stages compute with each output token: ``top``
    (``sampling_parameters``' ``logprobs``; 0 when absent) for ``return_logprobs``, 0 (the sampled token's alone)
    for ``return_cumulative_logprob`` alone, else None (none computed, whatever ``logprobs`` says: as the vLLM
    backend, which returns them only with ``return_logprobs``)."""
    if raw.return_logprobs:
        return top or 0
    return 0 if raw.return_cumulative_logprob else None


def _one_text(name: str, values: list[bytes], limits: InputLimits) -> str:
    """The one non-empty UTF-8 string of input ``name`` (``text_input`` or ``prompt``), at most
    ``max_prompt_bytes``. Raises InvalidInput naming the input."""
    if len(values) != 1:
        other = "'messages', 'prompt' or 'prompt_token_ids'" if name == "text_input" else \
            "'text_input', 'messages' or 'prompt_token_ids'"
        raise InvalidInput(f"{name}: expected one string, got {len(values)} (or send {other})")
    if len(values[0]) > limits.max_prompt_bytes:
        raise InvalidInput(f"{name}: {len(values[0])} bytes, over the limit of {limits.max_prompt_bytes}")
    try:
        text = values[0].decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"{name}: the prompt is not valid UTF-8") from None
    if not text.strip():
        raise InvalidInput(f"{name}: the prompt is empty")
    return text


def _conversation(raw: RawRequest, limits: InputLimits) -> tuple[Turn, ...]:
    if len(raw.messages) != 1:
        raise InvalidInput(f"messages: expected one JSON string, got {len(raw.messages)}")
    return parse_messages(raw.messages[0], limits.max_prompt_bytes)


def _placeholder_order(turns: tuple[Turn, ...], given: list[str]) -> list[int]:
    """The indices of the media items of kinds ``given`` (in input order) in the order of the conversation's
    placeholders (the k-th image placeholder is the k-th image). Raises InvalidInput naming each kind whose
    placeholders and items differ in number."""
    kinds = media_kinds(turns)
    by_kind = {kind: [k for k, g in enumerate(given) if g == kind] for kind in ("image", "video")}
    wrong = [f"{_counted(kinds.count(kind), kind + ' placeholder')}, but the request has "
             f"{_counted(len(items), kind)} (inputs {kind} and {kind}_url)"
             for kind, items in by_kind.items() if kinds.count(kind) != len(items)]
    if wrong:
        raise InvalidInput(f"messages: {'; '.join(wrong)}")
    return [by_kind[kind].pop(0) for kind in kinds]


def _counted(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _placed(check: Callable[[], MediaInput], position: str) -> MediaInput:
    """The checked item with its ``position`` ("item K of N", or ""), which its errors name too: ``image_url (item 2
    of 3): no such file ...``. Raises InvalidInput."""
    try:
        return replace(check(), position=position)
    except InvalidInput as exc:
        if not position:
            raise
        name, _, problem = str(exc).partition(": ")
        raise InvalidInput(f"{name} ({position}): {problem}") from None


def _url_input(kind: str, url: bytes, limits: InputLimits) -> MediaInput:
    try:
        return _resolve_url(kind, url.decode("utf-8"), limits)
    except UnicodeDecodeError:
        raise InvalidInput(f"{kind}_url: not valid UTF-8") from None
