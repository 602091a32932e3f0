"""How a chat template takes a message's content, as vLLM 0.26 tells (``--chat-template-content-format auto``,
``vllm/entrypoints/chat_utils.py``): "openai" when the template loops over a message's content (its parts,
``{"type": "text", "text": ...}`` and ``{"type": "image"}``), as Qwen2.5-VL's and InternVL3's own templates do; else
"string": the template is handed each message's content as one string. vLLM writes that string as its media parts'
placeholders first, one a line, then the texts joined by line breaks (``_get_full_multimodal_text_prompt``), the
placeholder being the model's (``get_placeholder_str``: ``Family.part_texts``), so a template written for text chats
(ChatML) serves images and videos.

The orchestrator's ``chat_template_content_format`` (the launcher's ``--chat-template-content-format``, vLLM's flag)
sets either format instead (:func:`chosen_format`).

One difference: vLLM groups a message's placeholders by kind (every image's, then every video's, when an image came
first); here they keep the parts' order, which is the order of the request's media items.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jinja2
from jinja2 import nodes
from transformers.utils.chat_template_utils import _compile_jinja_template

AUTO, OPENAI, STRING = "auto", "openai", "string"


@functools.lru_cache(maxsize=16)
def content_format(template: str | None) -> str:
    """:data:`OPENAI` or :data:`STRING` for ``template`` (module docstring): OPENAI when a ``for`` loop of it runs
    over a ``content`` attribute or item (``message['content']``, ``message.content``, through filters or a name set
    from one), when it cannot be parsed (rendering it raises the error) and for no template; STRING otherwise."""
    if not template:
        return OPENAI
    try:
        tree = _compile_jinja_template(template).environment.parse(template)
    except jinja2.TemplateError:
        return OPENAI
    contents = {assign.target.name for assign in tree.find_all(nodes.Assign)
                if isinstance(assign.target, nodes.Name) and _reads_content(assign.node, set())}
    loops = tree.find_all(nodes.For)
    return OPENAI if any(_reads_content(loop.iter, contents) for loop in loops) else STRING


def chosen_format(template: str | None, chosen: str = AUTO) -> str:
    """``chosen`` (the orchestrator's ``chat_template_content_format``, vLLM's ``--chat-template-content-format``):
    :data:`OPENAI` or :data:`STRING` as it is, :data:`AUTO` what :func:`content_format` tells from ``template``."""
    return content_format(template) if chosen == AUTO else chosen


def _reads_content(expression: nodes.Node, contents: set[str]) -> bool:
    """Whether ``expression`` reads a ``content`` attribute or item, or a name of ``contents``."""
    for node in (expression, *expression.find_all((nodes.Getattr, nodes.Getitem, nodes.Name))):
        if isinstance(node, nodes.Getattr) and node.attr == "content":
            return True
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content":
            return True
        if isinstance(node, nodes.Name) and node.name in contents:
            return True
    return False


def string_content(parts: Sequence[tuple[str, str]], part_texts: dict[str, str]) -> str:
    """A message's content as one string (module docstring). ``parts``: (kind, text) in order, the text of a media
    part unused; ``part_texts``: each media kind's text (``Family.part_texts``)."""
    media = [part_texts[kind] for kind, _ in parts if kind != "text"]
    return "\n".join([*media, "\n".join(text for kind, text in parts if kind == "text")])
