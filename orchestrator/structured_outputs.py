"""The ``structured_outputs`` sampling parameter, vLLM's name and shape: what a request's output must match.

An object (or its JSON text, as the Triton vLLM backend takes it) with exactly one of ``json`` (a JSON schema: an
object, or its JSON text), ``json_object`` (true: any JSON object), ``regex`` (a regular expression), ``choice`` (a
list of strings: the output is one of them) and ``grammar`` (EBNF, xgrammar's dialect), and optionally
``disable_any_whitespace`` (true: JSON without free whitespace between its tokens) and ``backend`` ("xgrammar" or
"auto": the one this server has). Also taken under its older name ``guided_decoding`` (``sampling_params.ALIASES``).
Checked here in full, so that a request the stages would not be able to hold is
refused naming the problem: xgrammar builds the grammar (``backends.runtime.sampling.grammar.build``, imported when
the first such request comes: xgrammar brings torch, which this package's modules do not import).
"""
from __future__ import annotations

import json

from backends.ipc.protocol import StructuredOutput

KINDS = ("json", "json_object", "regex", "choice", "grammar")
OPTIONS = ("disable_any_whitespace", "backend")
MAX_CHARS = 65536  # a schema, regex or grammar's text: bounds the compile work one request can cause
MAX_CHOICES = 1024


def parse_structured_outputs(key: str, value: object) -> StructuredOutput | None:
    """``value`` (the parsed JSON of ``sampling_parameters``' ``structured_outputs``) as the stages take it; None
    for null. Raises ValueError naming ``key`` and what is wrong (the caller makes it the client's error)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{key}: a string must hold a JSON object, got {_cut(value)}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be an object holding one of {', '.join(KINDS)}, got {type(value).__name__}")
    unknown = sorted(set(value) - {*KINDS, *OPTIONS})
    if unknown:
        raise ValueError(f"{key}: unknown key {unknown[0]!r} (known: {', '.join(KINDS + OPTIONS)})")
    if value.get("backend") not in (None, "xgrammar", "auto"):
        raise ValueError(f"{key}.backend: this server holds structured outputs with xgrammar, got {value['backend']!r}")
    given = [kind for kind in KINDS if value.get(kind) not in (None, False)]
    if len(given) != 1:
        raise ValueError(f"{key} must hold exactly one of {', '.join(KINDS)}, got {given or 'none'}")
    kind, rule = given[0], value[given[0]]
    plain = value.get("disable_any_whitespace", False)
    if not isinstance(plain, bool):
        raise ValueError(f"{key}.disable_any_whitespace must be a boolean, got {plain!r}")
    spec = StructuredOutput(*_kind_and_text(f"{key}.{kind}", kind, rule), any_whitespace=not plain)
    if len(spec.text) > MAX_CHARS:
        raise ValueError(f"{key}.{kind} is {len(spec.text)} characters long, at most {MAX_CHARS}")
    from backends.runtime.sampling.grammar import build  # xgrammar, torch: the first such request loads them

    try:
        build(spec)
    except ValueError as exc:
        raise ValueError(f"{key}.{kind}: {exc}") from None
    return spec


def _kind_and_text(where: str, kind: str, rule: object) -> tuple[str, str]:
    if kind == "json_object":
        if rule is not True:
            raise ValueError(f"{where} must be true, got {rule!r}")
        return kind, ""
    if kind == "json" and isinstance(rule, dict):
        return kind, json.dumps(rule)
    if kind == "choice":
        if not (isinstance(rule, list) and 0 < len(rule) <= MAX_CHOICES
                and all(isinstance(choice, str) and choice for choice in rule)):
            raise ValueError(f"{where} must be a list of 1 to {MAX_CHOICES} non-empty strings, got {_cut(rule)}")
        return "grammar", choices_grammar(rule)
    if not (isinstance(rule, str) and rule.strip()):
        raise ValueError(f"{where} must be a non-empty string{' or an object' if kind == 'json' else ''}, "
                         f"got {_cut(rule)}")
    return kind, rule


def choices_grammar(choices: list[str]) -> str:
    """EBNF matching exactly one of ``choices`` (vLLM's ``choice``): each a JSON-quoted literal, which xgrammar's
    EBNF strings read alike (its escapes, any Unicode)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _cut(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
