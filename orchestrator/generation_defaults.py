"""A checkpoint's ``generation_config.json`` as the default sampling parameters of its requests.

vLLM's rule (its ``--generation-config auto``, the default; ``ModelConfig.get_diff_sampling_param``): the values
the file sets apart from transformers' ``GenerationConfig`` defaults (``to_diff_dict``) among ``temperature``,
``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` become the defaults of requests that do not send them, and
its ``max_new_tokens`` caps a reply whose request sends no ``max_tokens`` (here: one that sends null, as the OpenAI
API's chat request without it; vLLM caps explicit ones too). So an Instruct checkpoint answers with its authors'
sampling unless a request says otherwise, as on vLLM. The orchestrator parameter ``generation_config`` is
``auto`` (that rule) or ``none`` (the built-in defaults, as ``RequestParams`` and Triton's vLLM backend have them:
vLLM's ``--generation-config vllm``). A preset without a checkpoint folder, or a folder without the file, has none.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from backends.triton.triton_io import choice_value
from orchestrator.sampling_params import InvalidInput, parse_sampling_parameters

KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """``sampling``: ``RequestParams`` field values for requests that do not send them; ``max_new_tokens``: the most
    output tokens of a request that sends ``max_tokens`` null (tokens), or None."""

    sampling: Mapping[str, float | int] = field(default_factory=dict)
    max_new_tokens: int | None = None


def generation_defaults(model_path: str | None, setting: str = "auto") -> GenerationDefaults:
    """The defaults of ``model_path``'s ``generation_config.json`` (``KEYS`` and ``max_new_tokens`` as it sets them
    apart from transformers' defaults), read with transformers' ``GenerationConfig``; none for ``setting`` ``none``,
    no ``model_path`` or no file.

    Raises:
        ValueError: ``setting`` is not ``auto`` or ``none``; the file cannot be read, or a value it sets is out of
            the range a request may send (the message names the file, the key and ``generation_config=none``).
    """
    setting = choice_value("generation_config", setting)
    if setting == "none" or model_path is None or not (Path(model_path) / FILE).is_file():
        return GenerationDefaults()
    from transformers import GenerationConfig  # the orchestrator reads it once, at start

    where, skip = Path(model_path) / FILE, "parameter generation_config=none serves without it"
    try:
        diff = GenerationConfig.from_pretrained(model_path).to_diff_dict()
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"{where}: cannot be read ({exc}); {skip}") from None
    given = {key: diff[key] for key in KEYS if diff.get(key) is not None}
    if diff.get("max_new_tokens") is not None:
        given["max_tokens"] = diff["max_new_tokens"]
    try:  # a request's rules: types converted as sent in sampling_parameters, ranges checked
        params = parse_sampling_parameters(json.dumps(given))
    except InvalidInput as exc:
        raise ValueError(f"{where}: {str(exc).replace('max_tokens', 'max_new_tokens')}; {skip}") from None
    return GenerationDefaults({key: getattr(params, key) for key in given if key != "max_tokens"},
                              params.max_tokens if "max_tokens" in given else None)
