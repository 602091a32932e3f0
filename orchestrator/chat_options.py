"""The ``chat_template_kwargs`` input: how the chat template is applied to a conversation (vLLM's chat request fields
``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs``; no Triton, no torch).

A JSON object: ``add_generation_prompt`` (boolean, default true: the prompt ends with the assistant's turn opened),
``continue_final_message`` (boolean, default false: the prompt ends inside the conversation's final message, which the
model continues: a "prefilled" answer; transformers' ``apply_chat_template`` rule, which vLLM applies), ``tools``
(a list of tool definitions, OpenAI's, handed to the template as ``apply_chat_template``'s ``tools``, where vLLM
puts a chat request's ``tools``: ``orchestrator.template_data``), and any other key, a variable of the model's chat
template (Qwen2.5-VL's ``add_vision_id``: "Picture 1: " before each image). Keys the template does not read are
ignored, as vLLM ignores them (``resolve_chat_template_kwargs``).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import jinja2.meta
from transformers.utils.chat_template_utils import _compile_jinja_template

from orchestrator.messages import Turn
from orchestrator.sampling_params import InvalidInput, json_value
from orchestrator.template_data import parse_tools

MAX_BYTES = 1 << 20  # a request's tools are sent here (an agent's tool list may run to tens of KiB)
# apply_chat_template's own arguments (or the conversation itself): not template settings (vLLM refuses the last two)
RESERVED = ("messages", "conversation", "documents", "chat_template", "tokenize")


@dataclass(frozen=True)
class ChatOptions:
    """How the template is applied. ``template_kwargs``: (name, value as JSON text) pairs, sorted by name (hashable:
    prompts are cached by them); ``tools``: the tool definitions as JSON text, or None."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: tuple[tuple[str, str], ...] = ()
    tools: str | None = None

    def kwargs_for(self, template: str) -> dict:
        """The template variables to pass: ``template_kwargs`` that ``template`` reads (jinja2's undeclared
        variables), decoded."""
        read = _variables(template)
        return {name: json.loads(value) for name, value in self.template_kwargs if name in read}

    def check(self, turns: tuple[Turn, ...]) -> None:
        """Raises InvalidInput (naming ``chat_template_kwargs``) when ``continue_final_message`` has no text to end
        the prompt in: the final message's last part must be text (transformers continues its last text part and
        would drop the media after it)."""
        if self.continue_final_message and (not turns or not turns[-1].parts or turns[-1].parts[-1].kind != "text"):
            raise InvalidInput("chat_template_kwargs: continue_final_message needs a final message that ends with "
                               "text, which the model continues")


def parse_chat_options(values: list[bytes]) -> ChatOptions:
    """The ``chat_template_kwargs`` input (none: the defaults). Raises InvalidInput naming it: not one UTF-8 JSON
    object of at most ``MAX_BYTES``, ``add_generation_prompt`` or ``continue_final_message`` not a boolean, both true
    (vLLM's rule), a key of ``RESERVED``, ``tools`` not a list of objects (``template_data.parse_tools``)."""
    if not values:
        return ChatOptions()
    if len(values) != 1 or len(values[0]) > MAX_BYTES:
        raise InvalidInput(f"chat_template_kwargs: expected one JSON object of at most {MAX_BYTES} bytes")
    raw = json_value("chat_template_kwargs", values[0])
    if not isinstance(raw, dict):
        raise InvalidInput(f"chat_template_kwargs: must be a JSON object, got {type(raw).__name__}")
    flags = {}
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        flags[name] = raw.pop(name, default)
        if not isinstance(flags[name], bool):
            raise InvalidInput(f"chat_template_kwargs: {name} must be true or false, got {json.dumps(flags[name])}")
    if flags["add_generation_prompt"] and flags["continue_final_message"]:
        raise InvalidInput("chat_template_kwargs: add_generation_prompt and continue_final_message cannot both be "
                           "true (set add_generation_prompt to false to continue the final message)")
    reserved = sorted(set(raw) & set(RESERVED))
    if reserved:
        raise InvalidInput(f"chat_template_kwargs: {reserved[0]} is not a template setting (not one of "
                           f"{', '.join(RESERVED)})")
    tools = parse_tools(raw.pop("tools", None))
    kwargs = tuple(sorted((name, json.dumps(value)) for name, value in raw.items()))
    return ChatOptions(flags["add_generation_prompt"], flags["continue_final_message"], kwargs, tools)


@functools.lru_cache(maxsize=16)
def _variables(template: str) -> frozenset[str]:
    """The variables ``template`` reads that it does not set itself (jinja2's ``find_undeclared_variables``), parsed
    in the environment transformers renders it in (its extensions: ``{% generation %}``, loop controls)."""
    environment = _compile_jinja_template(template).environment
    return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(template)))
