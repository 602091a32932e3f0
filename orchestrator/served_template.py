"""The server's own chat template (vLLM's ``--chat-template``): the orchestrator's ``chat_template`` parameter, which
the launcher's ``--chat-template`` sets, replaces the checkpoint's template for every chat (``/tokenize`` too).

The value is read as vLLM 0.26 reads its flag (``vllm/entrypoints/chat_utils.py``, ``load_chat_template``): a file
that can be opened is read; otherwise a value with none of :data:`JINJA_CHARS` looks like a path and is refused,
and any other value is the template itself, its backslash escapes decoded (``\\n`` written on a command line is a
line break). The template is compiled as transformers compiles it. It takes a message's content as a list of parts
(``{"type": "text", "text": ...}``, ``{"type": "image"}``), as Qwen2.5-VL's and InternVL3's own do (vLLM's "openai"
content format), or as one string, each media part's placeholder on a line of its own before the texts (vLLM's
"string" format, told apart as vLLM does: ``orchestrator.content_format``); the prompt's text and media are placed
by those parts (``orchestrator.prompt``). The server tokenizes each text part on its own (so that no text can bring
in a special token), so the template must write a text as it is: a filter on it (``trim``, cutting a ``<think>``
part out of an assistant's text) does not apply. A text the template leaves out (a system message it skips) is left
out of the prompt, as on vLLM.
"""
from __future__ import annotations

import re

import jinja2
from transformers.utils.chat_template_utils import _compile_jinja_template

from flashcodec.families import Family
from orchestrator.chat_options import ChatOptions
from orchestrator.content_format import AUTO, STRING, chosen_format
from orchestrator.prompt import TEXT_MARK, templated_text
from orchestrator.sampling_params import InvalidInput

JINJA_CHARS = "{}\n"  # vLLM's test of a value that is a template and not a file path


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


def with_template(tokenizer, template: str | None, family: Family, content: str = AUTO):
    """``tokenizer`` (transformers') with ``template`` (:func:`load_chat_template`'s) as its chat template, or as it
    is for None; ``content``: how the template takes a message's content (``orchestrator.content_format``). The
    template (the checkpoint's too, where ``content`` is not ``auto``) is tried on probe conversations first (a system
    message, a user message with one part of each of ``family``'s media kinds and a text, an assistant's and a user's
    text; then the user's message alone): it must write the last user text and the placeholder of one media kind at
    least, each it writes once and in order, and, where it takes the content as a list, read the parts (not write the
    list as a string). A kind whose placeholder it never writes (a template for images only, as vLLM takes one) is
    refused per request (``orchestrator.prompt.build_chat_prompt``). A probe
    the template refuses itself (``raise_exception``: it wants other conversations) is skipped. Raises ValueError
    naming the parameter ``chat_template`` (or ``chat_template_content_format``, where it is set) for a template that
    fails a probe."""
    if template is None and content == AUTO:
        return tokenizer
    if template is not None:
        tokenizer.chat_template = template
    where = "parameter chat_template" if content == AUTO else \
        f"parameter chat_template_content_format {content} (the launcher's --chat-template-content-format)"
    asking = ("user", (*family.placeholders, "text"), ())
    for shape in ((("system", ("text",), ()), asking, ("assistant", ("text",), ()), ("user", ("text",), ())),
                  (asking,)):
        try:
            written = templated_text(tokenizer, shape, ChatOptions(), family, content)
        except InvalidInput:  # the template's own refusal of this conversation
            continue
        except Exception as exc:  # noqa: BLE001 - whatever the template raised (a TypeError on a list) is its fault
            taken = "one string" if chosen_format(tokenizer.chat_template, content) == STRING else "a list of parts"
            raise ValueError(f"{where}: the template cannot write a message whose content is {taken} "
                             f"({type(exc).__name__}: {exc})") from None
        _check_written(written, sum(kinds.count("text") for _, kinds, _ in shape) - 1, family, where)
    return tokenizer


def _check_written(written: str, last_text: int, family: Family, where: str) -> None:
    """Raises ValueError (module docstring's rules) naming ``where`` for a probe's ``written`` prompt, ``last_text``
    the index of its last text's mark."""
    if "'type': 'text'" in written:
        raise ValueError(f"{where}: the template writes a message's content, a list of parts, as a string; it should "
                         "read its parts ({'type': 'text', 'text': ...}, {'type': 'image'}), as the model's own "
                         "template does, or take the content as one string (vLLM's 'string' content format: "
                         "orchestrator/content_format.py)")
    if TEXT_MARK.format(last_text) not in written:
        raise ValueError(f"{where}: the template does not write the user's text as it is (the server tokenizes each "
                         "text part on its own: a template may not change it)")
    order = list(family.placeholders.values())
    found = re.findall("|".join(map(re.escape, order)), written)
    if not found or found != [token for token in order if token in found]:
        raise ValueError(f"{where}: for a message with one part of each media kind "
                         f"({', '.join(family.placeholders)}) the template must write {' then '.join(order)}, "
                         f"or some of them, once each and in order; it wrote {found or 'none'} ({family.name}'s chat "
                         "template places its media by these tokens)")
