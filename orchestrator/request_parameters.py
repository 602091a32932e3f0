"""A request's own Triton parameters as its sampling parameters, as Triton's vLLM backend reads them: where a request
has no ``sampling_parameters`` input, that backend builds its sampling settings from ``request.parameters()``
(its ``utils/request.py``): the ``parameters`` object of a KServe or generate body
(``{"text_input": "...", "parameters": {"temperature": 0, "max_tokens": 5}}``) or ``tritonclient``'s
``parameters=`` argument. The ``sampling_parameters`` input wins where both are sent, as on that backend.

Keys that are not sampling settings are left out: ``stream`` (Triton's generate examples put it there; the
``stream`` input decides, as on the vLLM backend) and Triton's reserved ``triton_`` keys. Every other key is read
as a ``sampling_parameters`` key would be, an unknown one refused (the vLLM backend drops the whole set, logging its
error, and samples with its defaults).
"""
from __future__ import annotations

import json

from orchestrator.sampling_params import INPUT, InvalidInput

NOT_SAMPLING = frozenset({"stream"})
RESERVED_PREFIX = "triton_"  # Triton's own parameters


def sampling_text(parameters: str) -> str | None:
    """The sampling keys of ``parameters`` (``request.parameters()``: a JSON object in a string; empty: none) as a
    ``sampling_parameters`` JSON string, or None where it has none."""
    given = json.loads(parameters) if parameters.strip() else {}
    kept = {key: value for key, value in given.items()
            if key not in NOT_SAMPLING and not key.startswith(RESERVED_PREFIX)}
    return json.dumps(kept) if kept else None


def renamed(exc: InvalidInput) -> InvalidInput:
    """``exc`` (a ``sampling_parameters: ...`` message) naming the request's ``parameters``, where the values came
    from."""
    text = str(exc)
    return InvalidInput(f"parameters{text[len(INPUT):]}" if text.startswith(INPUT) else text)
