"""Per-request parameters: the `sampling_parameters` JSON string that the Triton vLLM backend takes.

Clients of that backend send every value as JSON, and genai-perf sends numbers as strings
(`{"max_tokens": "256", "min_tokens": "256"}`), so numeric strings are accepted for numbers.
Everything is checked here, at the orchestrator, and a bad value is answered with `InvalidInput`
naming the key (docs/design.md, invariant 3).
"""

import json
import math
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Callable, Mapping

from backends.ipc.protocol import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, StructuredOutput
from flashcodec.families.base import MediaOptions
from orchestrator.sampling_aliases import aliases_of, by_key, key_of
from orchestrator.shown import shown
from orchestrator.structured_outputs import parse_structured_outputs

# Qwen2.5-VL's smallest and largest frame area (qwen_vl_utils MIN_PIXELS = 4*28*28, MAX_PIXELS = 16384*28*28).
MIN_PIXELS = 4 * 28 * 28
MAX_PIXELS = 16384 * 28 * 28
MAX_FPS = 60.0
MAX_FRAMES = 1024  # num_frames: segments of a video (InternVL3: 256 tokens each)
MAX_TILES = 64  # max_tiles, min_tiles: tiles of an image's grid (InternVL3's checkpoints use 1 to 12)
# the family taking each setting, named in its range's refusal (the family check comes later, at admission: media.py)
FAMILY_OF = {"max_pixels": "a Qwen2.5-VL", "min_pixels": "a Qwen2.5-VL", "max_tiles": "an InternVL3",
             "min_tiles": "an InternVL3"}
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit; bounds the work one request's logit_bias adds to its steps
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (vLLM's, after OpenAI's)
MAX_TOKENS_LIMIT = 1 << 31  # max_tokens and token ids below it: far beyond any vocabulary or max_model_len
SEED_LIMIT = 2**63  # seeds go into an int64 generator seed
INPUT = "sampling_parameters"  # the input these parameters come in, which every message names first


class InvalidInput(ValueError):
    """User input that the server rejects; the message names the offending input or key."""


@dataclass(frozen=True)
class RequestParams:
    """Generation and media parameters of one request.

    Attributes:
        max_tokens: most tokens to generate (>= 1), or None (JSON null): the rest of the context, at most the
            orchestrator's ``default_max_tokens`` (vLLM's ``SamplingParams`` reads None as "up to max_model_len";
            the OpenAI API sends it for a chat request without ``max_tokens``: ``orchestrator.reply_limit``).
        min_tokens: tokens generated before EOS and stop strings may end the output (0 .. max_tokens).
        ignore_eos: keep generating after EOS until max_tokens.
        temperature: softmax temperature (>= 0; 0, or below 1e-5 as in vLLM, means greedy).
        top_p: nucleus probability mass, in (0, 1].
        top_k: keep the k most likely tokens; 0 is off (-1, vLLM's "off", is stored as 0).
        min_p: keep the tokens at least this share of the most likely token's probability, in [0, 1]; 0 is off
            (vLLM's ``min_p``).
        seed: per-request sampling seed in [0, 2**63), or None.
        stop: strings that end the output (not included in it unless ``include_stop_str_in_output``); at most 16,
            of at most 256 characters.
        include_stop_str_in_output: a stop string that ends the output stays in its text, and so does the text of
            the eos or stop token that ends it (vLLM's; by default neither does, the token's id being out all the
            same).
        skip_special_tokens: special tokens (``<|im_end|>``, ``<|vision_start|>``) have no text in the output
            (the default, vLLM's) or their own.
        stop_token_ids: token ids that end the output as eos does (finish reason "stop"; its id in the output's
            ids, its text not unless ``include_stop_str_in_output``), at most 256, distinct (repeats dropped, as
            vLLM does); checked against the vocabulary at admission.
        repetition_penalty: > 0, 1 is off; presence_penalty, frequency_penalty: in [-2, 2], 0 is off (their
            meaning: ``backends.ipc.protocol.SamplingParams``).
        fps: video frames sampled per second of video, in (0, 60], or None for the model family's default
            (Qwen2.5-VL 2.0; InternVL3 samples ``num_frames`` segments unless fps is set).
        max_pixels: largest area of a resized frame or image (pixels), in [4*28*28, 16384*28*28], or None
            for the model's default (Qwen2.5-VL).
        min_pixels: smallest area of a resized frame or image (pixels), in the same range, or None for the model's
            default (Qwen2.5-VL: 4*28*28 for an image, 128*28*28 for a video's frame; qwen-vl-utils' and
            transformers' ``min_pixels``); above ``max_pixels`` the media's plan refuses it.
        num_frames: segments a video is cut into, one frame each, in [1, 1024], or None (InternVL3).
        max_tiles: most 448-pixel tiles of an image's grid (its thumbnail not counted), in [1, 64], or None for the
            checkpoint's (InternVL3).
        min_tiles: fewest tiles of an image's grid, in [1, 64], or None for the checkpoint's (InternVL3); above the
            max_tiles that applies (the request's, the server's or the checkpoint's) the image's plan refuses it.
        dynamic_image_size: False: an image is one tile, no grid nor thumbnail, whatever min_tiles and max_tiles say
            (vLLM 0.26 ``resolve_internvl_min_max_num``; transformers' ``crop_to_patches``); True or None: tiled
            (InternVL3).
        logprobs: with each output token, the log probabilities of this many most likely tokens besides its own,
            in [0, 20] (vLLM's ``max_logprobs``), or None; computed only where an output asks for them
            (``return_logprobs``, ``return_cumulative_logprob``: ``orchestrator.inputs``).
        logit_bias: ``(token id, bias)`` pairs, at most 300 (OpenAI's limit), ids distinct and >= 0 (checked
            against the vocabulary at admission), biases in [-100, 100]: added to those tokens' logits (OpenAI's
            ``logit_bias``, a JSON object of token ids to biases, each clamped to [-100, 100] as vLLM does).
        prompt_logprobs: the log probabilities of the prompt's tokens after the first, each with this many most likely
            tokens at its position besides its own, in [0, 20], or None (vLLM's ``prompt_logprobs``): the first
            response's ``prompt_logprobs`` output. Such a prompt is not looked up in the prefix cache (every position's
            logits are computed) but cached as others are (vLLM v1's ``skip_reading_prefix_cache``).
        structured_outputs: what the output must match (vLLM's ``structured_outputs``:
            ``orchestrator.structured_outputs``), or None; ``min_tokens`` must then be 0.
        Which media settings apply is the served family's (``flashcodec.families``; the orchestrator refuses the
        others).

    Raises:
        InvalidInput: a value is out of range (the message names the key).
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    fps: float | None = None
    max_pixels: int | None = None
    min_pixels: int | None = None
    num_frames: int | None = None
    max_tiles: int | None = None
    min_tiles: int | None = None
    dynamic_image_size: bool | None = None
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_outputs: StructuredOutput | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # far beyond any max_model_len; bounds what messages print
        if self.max_tokens is not None and not 0 < self.max_tokens < MAX_TOKENS_LIMIT:
            _fail("max_tokens", "must be a positive integer below 2**31", self.max_tokens)
        if self.max_tokens is None and not 0 <= self.min_tokens < MAX_TOKENS_LIMIT:
            _fail("min_tokens", "must be an integer in [0, 2**31)", self.min_tokens)
        if self.max_tokens is not None and not 0 <= self.min_tokens <= self.max_tokens:
            _fail("min_tokens", f"must be in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            _fail("temperature", "must be a finite number >= 0", self.temperature)
        if not 0 < self.top_p <= 1:
            _fail("top_p", "must be in (0, 1]", self.top_p)
        if self.top_k < -1:
            _fail("top_k", "must be -1 or 0 (off) or a positive integer", self.top_k)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)  # one spelling of "off" downstream
        if not 0 <= self.min_p <= 1:
            _fail("min_p", "must be in [0, 1]", self.min_p)
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            _fail("seed", "must be in [0, 2**63)", self.seed)
        if any(not isinstance(s, str) or not s for s in self.stop):
            _fail("stop", "must hold non-empty strings", self.stop)
        # Every new token is matched against every stop string: bound the work one request can cause.
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidInput(f"{INPUT}: stop must hold at most {MAX_STOP_STRINGS} strings of at most "
                               f"{MAX_STOP_CHARS} characters, got {len(self.stop)} strings, the longest "
                               f"{max(map(len, self.stop))} characters")
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", f"must hold at most {MAX_STOP_TOKEN_IDS} token ids >= 0", self.stop_token_ids)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            _fail("repetition_penalty", "must be a finite number > 0", self.repetition_penalty)
        for key in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, key) <= MAX_PENALTY:
                _fail(key, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", getattr(self, key))
        if self.fps is not None and not 0 < self.fps <= MAX_FPS:
            _fail("fps", f"must be in (0, {MAX_FPS:g}]", self.fps)
        for key, low, high in (("num_frames", 1, MAX_FRAMES), ("max_tiles", 1, MAX_TILES), ("min_tiles", 1, MAX_TILES),
                               ("max_pixels", MIN_PIXELS, MAX_PIXELS), ("min_pixels", MIN_PIXELS, MAX_PIXELS),
                               ("logprobs", 0, MAX_LOGPROBS), ("prompt_logprobs", 0, MAX_LOGPROBS)):
            if getattr(self, key) is not None and not low <= getattr(self, key) <= high:
                whose = f" ({FAMILY_OF[key]} setting)" if key in FAMILY_OF else ""
                _fail(key, f"must be in [{low}, {high}]{whose}", getattr(self, key))
        ids, biases = [t for t, _ in self.logit_bias], [b for _, b in self.logit_bias]
        if len(ids) > MAX_LOGIT_BIAS_ENTRIES or len(set(ids)) != len(ids) or not all(
                0 <= t < MAX_TOKENS_LIMIT for t in ids) or not all(
                -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in biases):
            _fail("logit_bias", f"must map at most {MAX_LOGIT_BIAS_ENTRIES} distinct token ids >= 0 to biases in "
                  f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", self.logit_bias)
        if self.structured_outputs is not None and self.min_tokens:  # it would mask the eos that ends a match
            _fail("min_tokens", "must be 0 with structured_outputs", self.min_tokens)

    @property
    def media(self) -> MediaOptions:
        """The media settings (``MediaOptions``' fields: ``fps``, ``max_pixels``, ``min_pixels``, ``num_frames``,
        ``max_tiles``, ``min_tiles``, ``dynamic_image_size``) as the families take them."""
        return MediaOptions(**{f.name: getattr(self, f.name) for f in fields(MediaOptions)})

    def sampling(self) -> SamplingParams:
        """The stages' part of these parameters (``backends.ipc.protocol.SamplingParams``)."""
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.seed, self.min_tokens, self.ignore_eos,
                              self.repetition_penalty, self.presence_penalty, self.frequency_penalty,
                              self.stop_token_ids, self.logprobs, self.logit_bias, self.structured_outputs,
                              self.prompt_logprobs, self.min_p)


def _fail(key: str, rule: str, value: object) -> None:
    raise InvalidInput(f"{INPUT}: {key} {rule}, got {shown(value)}")


def _numeric_text(value: object) -> str | None:
    """A string's number, stripped, or None: ASCII only (``int()`` also takes other scripts' digits, "٣" is 3)
    and no underscores (``int("1_000")`` is 1000 in Python, not in JSON or C)."""
    if isinstance(value, str) and value.isascii() and "_" not in value:
        return value.strip()
    return None


def _as_int(key: str, value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number, text = value, _numeric_text(value)
    if text is not None:
        try:
            return int(text)
        except ValueError:
            try:
                number = float(text)  # "4.0", as the number 4.0 is taken
            except ValueError:
                pass
    if isinstance(number, float) and number.is_integer():
        return int(number)
    raise InvalidInput(f"{INPUT}: {key} must be an integer, got {shown(value)}")


def _as_float(key: str, value: object) -> float:
    number, text = math.nan, _numeric_text(value)
    try:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)  # OverflowError for an integer beyond float's range
        elif text is not None:
            number = float(text)
    except (ValueError, OverflowError):
        pass
    if not math.isfinite(number):
        raise InvalidInput(f"{INPUT}: {key} must be a finite number, got {shown(value)}")
    return number


def as_bool(key: str, value: object) -> bool:
    """A JSON boolean, or "true"/"false" (the vLLM backend's bool("false") is True). Raises InvalidInput naming key."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InvalidInput(f"{INPUT}: {key} must be a boolean, got {value!r}")


def json_value(where: str, raw: bytes | str) -> object:
    """``raw`` (UTF-8 bytes or text) as JSON. Raises InvalidInput naming ``where``: not UTF-8, not JSON (the parser's
    message), nested too deep (``json`` raises RecursionError past Python's recursion limit, about a thousand levels,
    not ValueError), an integer of over 4,300 digits (``int``'s conversion limit)."""
    try:
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except UnicodeDecodeError:
        raise InvalidInput(f"{where}: not valid UTF-8") from None
    except RecursionError:
        raise InvalidInput(f"{where}: arrays or objects nested thousands deep (past the JSON parser's limit)") from None
    except ValueError as exc:  # a JSONDecodeError, or int()'s limit (whose message ends advising a Python call)
        raise InvalidInput(f"{where}: not valid JSON ({str(exc).split(';')[0]})") from None


def unicode_text(where: str, text: str) -> str:
    """``text`` when it is Unicode text; a JSON escape of a lone UTF-16 surrogate (``"\\ud800"``) decodes to a code
    point that no UTF-8 text holds, which the tokenizer cannot take and no output can match. Raises InvalidInput
    naming ``where``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{where}: not valid Unicode text (a lone surrogate {text[exc.start]!r} at character "
                           f"{exc.start})") from None
    return text


def _as_stop(key: str, value: object) -> tuple[str, ...]:
    if value is None:  # none, as the OpenAI API's and vLLM's null
        return ()
    if isinstance(value, str):
        return (unicode_text(f"{INPUT}: {key}", value),)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(unicode_text(f"{INPUT}: {key}[{k}]", s) for k, s in enumerate(value))
    raise InvalidInput(f"{INPUT}: {key} must be a string or a list of strings, got {value!r}")


def _as_token_ids(key: str, value: object) -> tuple[int, ...]:
    if value is None:  # vLLM's "none"
        return ()
    if isinstance(value, list):
        try:
            return tuple(_as_int(key, v) for v in value)
        except InvalidInput:
            pass
    raise InvalidInput(f"{INPUT}: {key} must be a list of integers, got {shown(value)}")


def _as_logit_bias(key: str, value: object) -> tuple[tuple[int, float], ...]:
    """An object of token ids (its keys, JSON strings of integers) to biases, each clamped to [-100, 100] as vLLM
    does (OpenAI's range); every problem named with the entry at fault."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidInput(f"{INPUT}: {key} must be an object of token ids to biases, got {shown(value)}")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidInput(f"{INPUT}: {key} has {len(value)} entries, at most {MAX_LOGIT_BIAS_ENTRIES}")
    out: dict[int, float] = {}
    keys: dict[int, object] = {}
    for token, bias in value.items():
        where = f"{key}[{shown(token)}]"
        token_id = _as_int(f"{where}'s key", token)
        if not 0 <= token_id < MAX_TOKENS_LIMIT:
            raise InvalidInput(f"{INPUT}: {where}'s key must be a token id, in [0, 2**31)")
        if token_id in out:
            raise InvalidInput(f"{INPUT}: {key} names token {token_id} twice ({keys[token_id]!r} and {token!r})")
        if isinstance(bias, bool):
            raise InvalidInput(f"{INPUT}: {where} must be a number, got {bias!r}")
        out[token_id] = min(max(_as_float(where, bias), -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS)
        keys[token_id] = token
    return tuple(out.items())


def _as_structured_outputs(key: str, value: object) -> StructuredOutput | None:
    try:
        return parse_structured_outputs(key, value)
    except ValueError as exc:
        raise InvalidInput(f"{INPUT}: {exc}") from None


def _optional(convert: Callable[[str, object], object]) -> Callable[[str, object], object]:
    """``convert``, taking null as None."""
    return lambda key, value: None if value is None else convert(key, value)


_CONVERTERS = {
    "max_tokens": _optional(_as_int),
    "min_tokens": _as_int,
    "ignore_eos": as_bool,
    "temperature": _as_float,
    "top_p": _as_float,
    "top_k": _as_int,
    "min_p": _as_float,
    "seed": _optional(_as_int),
    "stop": _as_stop,
    "include_stop_str_in_output": as_bool,
    "skip_special_tokens": as_bool,
    "stop_token_ids": _as_token_ids,
    "repetition_penalty": _as_float,
    "presence_penalty": _as_float,
    "frequency_penalty": _as_float,
    "fps": _optional(_as_float),
    "max_pixels": _optional(_as_int),
    "min_pixels": _optional(_as_int),
    "num_frames": _optional(_as_int),
    "max_tiles": _optional(_as_int),
    "min_tiles": _optional(_as_int),
    "dynamic_image_size": _optional(as_bool),
    "logprobs": _optional(_as_int),
    "prompt_logprobs": _optional(_as_int),
    "logit_bias": _as_logit_bias,
    "structured_outputs": _as_structured_outputs,
}
KEYS = tuple(_CONVERTERS)  # the sampling keys, their aliases aside (orchestrator.sampling_aliases)


def parse_sampling_parameters(text: str | None, keys: tuple[str, ...] = KEYS,
                              defaults: Mapping[str, object] = MappingProxyType({})) -> RequestParams:
    """Parses the `sampling_parameters` input (a JSON object in a string) that may hold `keys` (all, by default; the
    orchestrator's `media_defaults` takes the media settings alone) and their aliases; `defaults` (values of
    `RequestParams` fields, e.g. the checkpoint's: `orchestrator.generation_defaults`) stand for keys it does not send.

    None, an empty string or JSON null gives the defaults. Integers are accepted for floats; integer-valued
    floats for integers; numeric strings for both (genai-perf's form); "true"/"false" for booleans;
    a string or a list of strings for `stop`; a list of integers for `stop_token_ids`; null for `seed`, `fps`,
    `max_pixels`, `min_pixels`, `num_frames`, `max_tiles`, `min_tiles`, `dynamic_image_size`, `logprobs` and
    `stop_token_ids`, and for `max_tokens` (the rest of the context: `RequestParams.max_tokens`; absent, it is 16). A
    key's alias (`orchestrator.sampling_aliases.ALIASES`: vLLM's and transformers' names) is read as that key; a key and
    its aliases sent together are one setting: equal values (or all but one null) pass, different ones are refused
    naming two.

    Raises:
        InvalidInput: invalid JSON, not an object, an unknown key, a wrong type or an out-of-range value, named.
    """
    if text is None or not text.strip():
        return RequestParams(**defaults)
    raw = json_value(INPUT, text)
    if raw is None:
        return RequestParams(**defaults)
    if not isinstance(raw, dict):
        raise InvalidInput(f"{INPUT}: must be a JSON object, got {type(raw).__name__}")
    known = [*keys, *aliases_of(keys)]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise InvalidInput(f"{INPUT}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
    values = {key: _CONVERTERS[key_of(key)](key, value) for key, value in raw.items()}
    try:
        values = by_key(values)
    except ValueError as exc:  # two names of one setting with different values
        raise InvalidInput(f"{INPUT}: {exc}") from None
    return RequestParams(**{**defaults, **values})
