"""The server's own chat template (vLLM's ``--chat-template``): the orchestrator's ``chat_template`` parameter, which
the launcher's ``--chat-template`` sets, replaces the checkpoint's template for every chat (``/tokenize`` too).

The value is read as vLLM 0.26 reads its flag (``vllm/entrypoints/chat_utils.py``, ``load_chat_template``): a file
that can be opened is read; otherwise a value with none of :data:`JINJA_CHARS` looks like a path and is refused,
and any other value is the template itself, its backslash escapes decoded (``\\n`` written on a command line is a
line break). The template is compiled as transformers compiles it, and must take a message's content as a list of
parts (``{"type": "text", "text": ...}``, ``{"type": "image"}``), as Qwen2.5-VL's and InternVL3's own do (vLLM's
"openai" content format): the prompt's text and media are placed by those parts (``orchestrator.prompt``).
"""
from __future__ import annotations

import jinja2
from transformers.utils.chat_template_utils import _compile_jinja_template

JINJA_CHARS = "{}\n"  # vLLM's test of a value that is a template and not a file path
_PROBE = "\x00chat-template-probe\x00"  # a text part's text, which a template of string contents writes inside a list


def load_chat_template(value: str) -> str | None:
    """The template ``value`` names (module docstring), or None for an empty value (the checkpoint's own). Raises
    ValueError naming the parameter ``chat_template``: a path that cannot be read, a file that is not UTF-8, a
    template jinja2 cannot compile (its line and reason)."""
    if not value.strip():
        return None
    try:
        with open(value, encoding="utf-8") as file:
            template = file.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"parameter chat_template: {value} is not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        if not any(char in value for char in JINJA_CHARS):
            raise ValueError(f"parameter chat_template: {value!r} looks like a file path, but it cannot be opened "
                             f"({exc.strerror})") from None
        # non-ASCII characters kept: they go through the escape decoding as escapes of their own
        template = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"parameter chat_template: not a valid Jinja template (line {exc.lineno}: {exc.message})") \
            from None
    return template


def with_template(tokenizer, template: str | None):
    """``tokenizer`` (transformers') with ``template`` (:func:`load_chat_template`'s) as its chat template, or as it
    is for None. Raises ValueError naming the parameter ``chat_template`` where the template writes a message's
    content as a string: it wrote a probe conversation's list of parts as Python's text of a list, or raised on it.
    A template that drops the text passes here; the prompt's own check refuses it per request."""
    if template is None:
        return tokenizer
    tokenizer.chat_template = template
    conversation = [{"role": "user", "content": [{"type": "text", "text": _PROBE}]}]
    try:
        written = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - whatever the template raised (a jinja2 error, a TypeError) is its fault
        raise ValueError(f"parameter chat_template: the template cannot write a message whose content is a list of "
                         f"parts ({type(exc).__name__}: {exc})") from None
    if repr(_PROBE) in written:
        raise ValueError("parameter chat_template: the template writes a message's content as a string; this server "
                         "needs one that reads its parts ({'type': 'text', 'text': ...}, {'type': 'image'}), as the "
                         "model's own template does (vLLM's 'openai' content format)")
    return tokenizer
