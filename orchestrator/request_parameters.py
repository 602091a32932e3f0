"""A request's own Triton parameters as its sampling parameters, as Triton's vLLM backend reads them: where a request
has no ``sampling_parameters`` input, that backend builds its sampling settings from ``request.parameters()``
(its ``utils/request.py``): the ``parameters`` object of a KServe or generate body
(``{"text_input": "...", "parameters": {"temperature": 0, "max_tokens": 5}}``) or ``tritonclient``'s
``parameters=`` argument. The ``sampling_parameters`` input wins where both are sent, as on that backend.

Triton's HTTP generate endpoint hands the model every top-level field of the body that is not an input as a
parameter too (``{"id": "r1", "text_input": "Hi", "max_tokens": 5}`` brings ``id`` and ``max_tokens``), beside the
``parameters`` object's keys. Keys that are not sampling settings are left out: the request's own fields, which
Triton acts on (:data:`NOT_SAMPLING`: ``id``, the request id it answers with; ``priority``, ``timeout`` and the
sequence keys, which only a model's scheduler applies: docs/operations.md), ``stream`` (Triton's generate examples
put it there; the ``stream`` input decides, as on the vLLM backend) and Triton's reserved ``triton_`` keys. Every
other key is read as a ``sampling_parameters`` key would be, an unknown one refused naming it (the vLLM backend
fails such a request too: its ``TritonSamplingParams.from_dict`` logs the error and returns None). Where the request
has ``sampling_parameters``, its parameters' sampling keys are not read, and any other key is refused (:func:`chosen`).
"""
from __future__ import annotations

import json

from orchestrator.sampling_aliases import aliases_of
from orchestrator.sampling_params import INPUT, KEYS, InvalidInput

NOT_SAMPLING = frozenset({"id", "priority", "timeout", "sequence_id", "sequence_start", "sequence_end",
                          "stream"})
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


def chosen(sampling_parameters: str | None, parameters: str) -> tuple[bool, str | None]:
    """Where a request's sampling settings come from: (whether from its ``parameters``, :func:`sampling_text`'s
    JSON; the text to parse). ``sampling_parameters`` wins where it comes, and the parameters' sampling keys are not
    read (the vLLM backend's rule); a key of theirs that is no sampling key is refused all the same, since Triton's
    generate endpoint passes a body's field that is no input as a parameter: a misspelled input (``video_urls``)
    would otherwise be dropped without a word (a fresh user's test: the video left out, 200).

    Raises:
        InvalidInput: naming ``parameters`` and the first such key.
    """
    if sampling_parameters is None:
        return bool(parameters), parameters or None
    unknown = sorted(set(json.loads(parameters) if parameters else ()) - {*KEYS, *aliases_of(KEYS)})
    if unknown:
        raise InvalidInput(f"parameters: unknown key {unknown[0]!r}: not an input of this model (Triton's generate "
                           "endpoint passes a body's other fields as parameters) nor a sampling key")
    return False, sampling_parameters
