"""The ``messages`` input: a whole conversation, as JSON, instead of ``text_input`` (no Triton, no torch).

Shape: OpenAI's chat messages with their media parts replaced by placeholders, a JSON array of
``{"role": "system" | "user" | "assistant" | "tool", "content": "..." | [part, ...]}`` where a part is
``{"type": "text", "text": "..."}``, ``{"type": "image"}`` or ``{"type": "video"}``. The k-th image placeholder
stands for the request's k-th image (input ``image``, then ``image_url``), the k-th video placeholder for its k-th
video (``video``, then ``video_url``). Media sit in user messages only, as in OpenAI's API. A ``tool`` message (a
tool's answer, OpenAI's) is written as the chat template writes that role (Qwen2.5-VL's and InternVL3's: as any
other, ``<|im_start|>tool``, as vLLM's prompt has it). An assistant message's ``tool_calls`` and a tool message's
``tool_call_id`` are handed to the template as vLLM hands them (``orchestrator.template_data``). The prompt is the
model's chat template over the conversation, then the assistant's turn (``orchestrator.prompt``).
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.sampling_params import InvalidInput, json_value, unicode_text
from orchestrator.template_data import message_fields

ROLES = ("system", "user", "assistant", "tool")
MEDIA_KINDS = ("image", "video")


@dataclass(frozen=True)
class Part:
    """One piece of a message: ``kind`` "text" (with ``text``), or "image" / "video" (a placeholder)."""

    kind: str
    text: str = ""


@dataclass(frozen=True)
class Turn:
    """One message of the conversation: ``role`` one of :data:`ROLES`, its parts in order, and its ``fields`` for
    the template besides them ((name, JSON text) pairs: ``template_data.message_fields``)."""

    role: str
    parts: tuple[Part, ...]
    fields: tuple[tuple[str, str], ...] = ()


def user_turn(text: str, media_kinds: list[str]) -> Turn:
    """The conversation of a ``text_input`` request: one user message, its media first (in request order), then
    its text."""
    return Turn("user", tuple(Part(kind) for kind in media_kinds) + (Part("text", text),))


def media_kinds(turns: tuple[Turn, ...]) -> list[str]:
    """The kinds of the conversation's placeholders, in prompt order."""
    return [part.kind for turn in turns for part in turn.parts if part.kind in MEDIA_KINDS]


def parse_messages(raw: bytes, max_bytes: int) -> tuple[Turn, ...]:
    """Validate the ``messages`` input (UTF-8 JSON of at most ``max_bytes`` bytes).

    A message's content may be empty, or null (no parts: OpenAI's assistant messages may have none), as vLLM renders
    them: the chat template still writes the roles.

    Raises InvalidInput naming the problem and where: ``messages`` (not JSON, not a non-empty array, over the size
    limit), ``messages[i]`` (not an object, unknown role, content neither a string, a list nor null, text that is
    not Unicode), ``messages[i].content[j]`` (a part that is not a text part or a placeholder, media outside a user
    message), ``messages[i].tool_calls...`` (``template_data.message_fields``).
    """
    if len(raw) > max_bytes:
        raise InvalidInput(f"messages: {len(raw)} bytes, over the limit of {max_bytes}")
    value = json_value("messages", raw)
    if not isinstance(value, list) or not value:
        raise InvalidInput("messages: must be a non-empty JSON array of messages")
    return tuple(_turn(i, message) for i, message in enumerate(value))


def _turn(i: int, message: object) -> Turn:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise InvalidInput(f"{where}: must be an object with 'role' and 'content', got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise InvalidInput(f"{where}: role must be one of {', '.join(ROLES)}, got {_shown(role)}")
    fields = message_fields(where, role, message)
    if isinstance(content, str):
        return Turn(role, (Part("text", unicode_text(f"{where}.content", content)),), fields)
    if content is None:
        return Turn(role, (), fields)
    if not isinstance(content, list):
        raise InvalidInput(f"{where}: content must be a string, a list of parts or null, got "
                           f"{type(content).__name__}")
    return Turn(role, tuple(_part(f"{where}.content[{j}]", role, part) for j, part in enumerate(content)), fields)


def _part(where: str, role: str, part: object) -> Part:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return Part("text", unicode_text(f"{where}.text", part["text"]))
    if kind in MEDIA_KINDS:
        if role != "user":
            raise InvalidInput(f"{where}: {kind} parts are allowed in user messages only, not in {role} messages")
        return Part(kind)
    if kind in ("image_url", "video_url"):
        raise InvalidInput(f"{where}: put the URL in the '{kind}' input and a placeholder "
                           f"{{\"type\": \"{kind[:5]}\"}} here")
    raise InvalidInput(f"{where}: must be {{\"type\": \"text\", \"text\": string}}, {{\"type\": \"image\"}} or "
                       f"{{\"type\": \"video\"}}, got {_shown(part)}")


def _shown(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."
