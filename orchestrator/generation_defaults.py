"""A checkpoint's ``generation_config.json`` as the default sampling parameters of its requests.

vLLM's rule (its ``--generation-config auto``, the default; ``ModelConfig.get_diff_sampling_param``): the values
the file sets apart from transformers' ``GenerationConfig`` defaults (``to_diff_dict``) among ``temperature``,
``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` become the defaults of requests that do not send them. So a
Qwen2.5-VL-7B-Instruct checkpoint answers with its authors' sampling unless a request says otherwise, as on vLLM.
The orchestrator parameter ``generation_config`` is ``auto`` (that rule) or ``none`` (the built-in defaults, as
``RequestParams`` and Triton's vLLM backend have them: vLLM's ``--generation-config vllm``). A preset without a
checkpoint folder, or a folder without the file, has no such defaults.
"""
from __future__ import annotations

import json
from pathlib import Path

from backends.triton.triton_io import choice_value
from orchestrator.sampling_params import InvalidInput, parse_sampling_parameters

KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FILE = "generation_config.json"


def generation_defaults(model_path: str | None, setting: str = "auto") -> dict[str, float | int]:
    """The default sampling parameters of ``model_path``'s ``generation_config.json`` (``KEYS`` it sets apart from
    transformers' defaults), read with transformers' ``GenerationConfig``; empty for ``setting`` ``none``, no
    ``model_path`` or no file.

    Raises:
        ValueError: ``setting`` is not ``auto`` or ``none``; the file cannot be read, or a value it sets is out of
            the range a request may send (the message names the file, the key and ``generation_config=none``).
    """
    setting = choice_value("generation_config", setting)
    if setting == "none" or model_path is None or not (Path(model_path) / FILE).is_file():
        return {}
    from transformers import GenerationConfig  # the orchestrator reads it once, at start

    where = Path(model_path) / FILE
    try:
        diff = GenerationConfig.from_pretrained(model_path).to_diff_dict()
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: cannot be read ({exc}); parameter generation_config=none serves without it") \
            from None
    given = {key: diff[key] for key in KEYS if diff.get(key) is not None}
    try:  # a request's rules: types converted as sent in sampling_parameters, ranges checked
        params = parse_sampling_parameters(json.dumps(given))
    except InvalidInput as exc:
        raise ValueError(f"{where}: {exc}; parameter generation_config=none serves without it") from None
    return {key: getattr(params, key) for key in given}
