"""The request fields that every generation route takes alike (chat completions, completions, responses), as vLLM's
requests share them: the model's name, ``stream``, the sampling parameters passed on to the orchestrator as its
``sampling_parameters`` keys, ``mm_processor_kwargs`` and ``structured_outputs``. Each route's body builds on
:class:`SamplingRequest` (``schemas.GenerationRequest``, ``responses_request.ResponsesRequest``).
"""
from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BeforeValidator, model_validator
from pydantic_core import PydanticCustomError

from backends.openai.bodies import Body, Flag, StrictBody
from backends.openai.ignored_fields import log_unknown
from backends.openai.unsupported import Unsupported
from orchestrator.sampling_params import InvalidInput, as_bool


def _spelled_bool(value: Any) -> bool | None:
    """A media flag as the orchestrator reads one (``orchestrator.sampling_params.as_bool``: a JSON boolean, or
    "true" / "false"): pydantic's lax "no", "off" or 0 are refused, not read as false, since vLLM hands
    ``mm_processor_kwargs`` to the processor unconverted, where a non-empty string is true. Raises
    PydanticCustomError (a 400 naming the field)."""
    if value is None:
        return None
    try:
        return as_bool("", value)
    except InvalidInput:
        raise PydanticCustomError("bool_spelled", "Input should be true or false (got {value})",
                                  {"value": json.dumps(value, default=str)}) from None


MediaFlag = Annotated[bool | None, BeforeValidator(_spelled_bool)]


class MediaOptions(StrictBody):
    """vLLM's ``mm_processor_kwargs``, the keys the orchestrator takes (``orchestrator.sampling_params``; which apply is
    the served family's): frames sampled per second of video, the largest and smallest resized frame or image area in
    pixels (Qwen2.5-VL), the segments a video is cut into, the most and fewest tiles of an image's grid and whether it
    is tiled at all (InternVL3; also under vLLM's InternVL names ``max_dynamic_patch``, ``min_dynamic_patch`` and
    transformers' ``max_patches``, ``min_patches``, ``crop_to_patches``, passed on as they are: the orchestrator's
    ``orchestrator.sampling_aliases.ALIASES`` read them as its keys)."""

    fps: float | None = None
    max_pixels: int | None = None
    min_pixels: int | None = None
    num_frames: int | None = None
    max_tiles: int | None = None
    min_tiles: int | None = None
    dynamic_image_size: MediaFlag = None
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    max_patches: int | None = None
    min_patches: int | None = None
    crop_to_patches: MediaFlag = None


# vLLM's media_io_kwargs (a chat's and a response's): refused when set (backends/openai/unsupported)
MediaIoKwargs = Annotated[dict[str, Any] | None, Unsupported(
    "not supported by this server (mm_processor_kwargs sets the frames and sizes)")]


class SamplingRequest(Body):
    """The fields every generation route takes alike; fields of the body that no route's schema declares are logged
    (``backends.openai.ignored_fields``), as vLLM warns of them. ``priority`` is refused when not 0 (vLLM refuses it
    without its priority scheduling policy)."""

    model: str | None = None  # None or "": the served model (vLLM's rule)

    @model_validator(mode="before")
    @classmethod
    def _log_unknown(cls, data: Any) -> Any:
        """The request's top-level fields this server does not know, logged (``backends.openai.ignored_fields``)."""
        if isinstance(data, dict):
            log_unknown(cls.__name__, data, cls.model_fields)
        return data

    stream: Flag = False
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extra parameters
    top_k: int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    mm_processor_kwargs: MediaOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key) -> bias in [-100, 100]
    structured_outputs: dict[str, Any] | str | None = None  # vLLM's: json, json_object, regex, choice, grammar
    priority: Annotated[int, Unsupported(
        "got {value} but priority scheduling is not enabled (requests are served first come, first served, as "
        "vLLM's default fcfs policy serves them)")] = 0
