"""The ``structured_outputs`` sampling parameter, vLLM's name and shape: what a request's output must match.

An object (or its JSON text, as the Triton vLLM backend takes it) with exactly one of ``json`` (a JSON schema: an
object, or its JSON text), ``json_object`` (true: any JSON object), ``regex`` (a regular expression), ``choice`` (a
list of strings: the output is one of them) and ``grammar`` (EBNF, xgrammar's dialect), and optionally
``disable_any_whitespace`` (true: JSON without free whitespace between its tokens) and ``backend`` ("xgrammar" or
"auto": the one this server has). Also taken under its older name ``guided_decoding`` (``sampling_aliases.ALIASES``).
Checked here in full, so that a request the stages would not be able to hold is
refused naming the problem: a JSON schema nested at most ``MAX_DEPTH`` deep (xgrammar's work grows with the cube of
the depth) and without the keywords xgrammar would not enforce (``unenforced``: vLLM refuses the same, its
``has_xgrammar_unsupported_json_features``), then xgrammar compiles it (``backends.runtime.sampling.grammar.check``,
loaded by the service at start: xgrammar brings torch, which this package's modules do not import).
"""
from __future__ import annotations

import json
import math

from backends.ipc.protocol import StructuredOutput
from orchestrator.shown import shown

KINDS = ("json", "json_object", "regex", "choice", "grammar")
OPTIONS = ("disable_any_whitespace", "backend")
MAX_CHARS = 65536  # a schema, regex or grammar's text: bounds the compile work one request can cause
MAX_CHOICES = 1024
MAX_DEPTH = 32  # a schema's arrays and objects nested in one another (64: 0.08 s to compile, 800: 24 s)
# JSON schema keywords xgrammar 0.2.8 compiles without enforcing (an output could break them: found by a break test
# and vLLM's list), and minLength/maxLength, whose strings it lets hold raw control characters (not JSON)
UNENFORCED = ("contains", "minContains", "maxContains", "uniqueItems", "patternProperties", "propertyNames",
              "dependentSchemas", "dependentRequired", "dependencies", "minProperties", "maxProperties", "not",
              "allOf", "if", "then", "else", "minLength", "maxLength")
SCHEMA_MAPS = ("properties", "$defs", "definitions")  # objects of names to schemas
DATA = ("enum", "const", "default", "examples", "required", "title", "description")  # not schemas
FORMATS = ("email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
           "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")  # the string formats it knows


def parse_structured_outputs(key: str, value: object) -> StructuredOutput | None:
    """``value`` (the parsed JSON of ``sampling_parameters``' ``structured_outputs``) as the stages take it; None
    for null. Raises ValueError naming ``key`` and what is wrong (the caller makes it the client's error)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # nested past the parser's recursion limit: RecursionError
            raise ValueError(f"{key}: a string must hold a JSON object, got {shown(value)}") from None
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
    from backends.runtime.sampling.grammar import check  # xgrammar (the service loads it at start)

    try:
        if spec.kind == "json":
            _check_schema(_parsed(spec.text))
        check(spec)
    except ValueError as exc:
        raise ValueError(f"{key}.{kind}: {exc}") from None
    return spec


def _check_schema(node: object, where: str = "the root", depth: int = 0, schema: bool = True) -> None:
    """Raises ValueError where ``node`` (parsed JSON; ``schema``: a schema's place, not data nor a map of names)
    nests deeper than ``MAX_DEPTH`` or holds a keyword xgrammar would not enforce (:func:`unenforced`)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested more than {MAX_DEPTH} deep (at {where})")
    if isinstance(node, list):
        for i, value in enumerate(node):
            _check_schema(value, f"{where}[{i}]", depth + 1, schema)
        return
    if not isinstance(node, dict):
        return
    if schema and (why := unenforced(node)) is not None:
        raise ValueError(f"{where}: {why}")
    for name, value in node.items():
        place = f"{name}" if where == "the root" else f"{where}.{name}"
        if schema and name in SCHEMA_MAPS and isinstance(value, dict):  # names -> schemas
            for key, sub in value.items():
                _check_schema(sub, f"{place}.{key}", depth + 2)
        else:  # data (enum, const, default, ...) is checked for its depth alone
            _check_schema(value, place, depth + 1, schema and name not in DATA)


def unenforced(node: dict) -> str | None:
    """What in one schema object xgrammar would compile without holding an output to it, or None: a keyword of
    ``UNENFORCED``, a ``format`` it does not know, a ``multipleOf`` that is not an integer, a ``$ref`` outside the
    schema, a ``pattern`` it cannot read (it drops lookarounds), or ``required`` names ``additionalProperties``
    false forbids."""
    if (word := next((w for w in UNENFORCED if w in node), None)) is not None:
        return f"{word!r} is not held by this server (xgrammar would let an output break it)"
    if "format" in node and node["format"] not in FORMATS:
        return f"format {node['format']!r} is not one xgrammar knows"
    if "multipleOf" in node and not (isinstance(node["multipleOf"], int) and not isinstance(node["multipleOf"], bool)):
        return f"multipleOf {node['multipleOf']!r}: only an integer is held"
    if "$ref" in node and not str(node["$ref"]).startswith("#"):
        return f"$ref {node['$ref']!r}: only references inside the schema (#/...) are followed"
    if isinstance(node.get("pattern"), str):
        from backends.runtime.sampling.grammar import check  # xgrammar: a pattern is its regex

        try:
            check(StructuredOutput("regex", node["pattern"]))
        except ValueError as exc:
            return f"pattern {node['pattern']!r}: {exc}"
    if node.get("additionalProperties") is False and isinstance(node.get("required"), list):
        allowed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if (missing := [name for name in node["required"] if name not in allowed]):
            return f"required {missing[0]!r} is not a property additionalProperties false allows: nothing matches"
    return None


def _kind_and_text(where: str, kind: str, rule: object) -> tuple[str, str]:
    if kind == "json_object":
        if rule is not True:
            raise ValueError(f"{where} must be true, got {rule!r}")
        return kind, ""
    if kind == "json" and isinstance(rule, dict):
        try:
            return kind, json.dumps(rule, allow_nan=False)
        except ValueError:  # 1e400 read as infinity
            raise ValueError(f"{where} holds a number beyond a double's range") from None
    if kind == "choice":
        if not (isinstance(rule, list) and 0 < len(rule) <= MAX_CHOICES
                and all(isinstance(choice, str) and choice for choice in rule)):
            raise ValueError(f"{where} must be a list of 1 to {MAX_CHOICES} non-empty strings, got {shown(rule)}")
        return "grammar", choices_grammar(rule)
    if not (isinstance(rule, str) and rule.strip()):
        raise ValueError(f"{where} must be a non-empty string{' or an object' if kind == 'json' else ''}, "
                         f"got {shown(rule)}")
    return kind, rule


def _finite(text: str) -> float:
    if not math.isfinite(number := float(text)):
        raise ValueError(f"the number {text} is beyond a double's range")
    return number


def _parsed(text: str) -> object:
    try:
        return json.loads(text, parse_float=_finite, parse_constant=_finite)
    except RecursionError:
        raise ValueError(f"nested more than {MAX_DEPTH} deep") from None
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None


def choices_grammar(choices: list[str]) -> str:
    """EBNF matching exactly one of ``choices`` (vLLM's ``choice``): each a JSON-quoted literal, which xgrammar's
    EBNF strings read alike (its escapes, any Unicode)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
