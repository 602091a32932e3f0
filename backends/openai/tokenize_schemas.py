"""Bodies of vLLM's ``/tokenize`` and ``/detokenize`` (its ``TokenizeCompletionRequest``, ``TokenizeChatRequest``,
``DetokenizeRequest`` and their responses). A tokenize request is the request it would be as a generation (a chat's
template options, its media and ``mm_processor_kwargs``; a completion's prompt), so it reuses those bodies and their
checks; the orchestrator builds its prompt (``tokenize_only``) and runs nothing.

``add_special_tokens`` is taken and has no effect: the served families' Qwen tokenizer adds no special tokens
around a prompt (no BOS), with it or without.
"""
from __future__ import annotations

from typing import Annotated, ClassVar, Union

from pydantic import BaseModel, Discriminator, Field, Tag

from backends.openai.convert import OrchestratorRequest, chat_request, completion_requests
from backends.openai.errors import BODY_KINDS
from backends.openai.bodies import Body, Flag
from backends.openai.schemas import TOKEN_ID_LIMIT, ChatCompletionRequest, CompletionRequest
from orchestrator.shown import shown


class TokenizeCompletionRequest(CompletionRequest):
    """``prompt``: one text, tokenized as it is, without the chat template."""

    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Flag = False

    def orchestrator_request(self) -> OrchestratorRequest:
        return completion_requests(self)[0]


class TokenizeChatRequest(ChatCompletionRequest):
    """``messages`` through the model's chat template, each image's and video's visual tokens counted as a chat
    completion would run them."""

    add_special_tokens: bool = False
    return_token_strs: Flag = False
    chooses_tools: ClassVar[bool] = False  # vLLM's takes tools (the template's), no tool_choice

    def orchestrator_request(self) -> OrchestratorRequest:
        return chat_request(self)


CHAT, COMPLETION = BODY_KINDS  # the tags, which errors leave out of a field's place


def _kind(body: object) -> str:
    """vLLM's rule: a body with ``messages`` is a chat's."""
    has_messages = "messages" in body if isinstance(body, dict) else hasattr(body, "messages")
    return CHAT if has_messages else COMPLETION


TokenizeRequest = Annotated[Union[Annotated[TokenizeCompletionRequest, Tag(COMPLETION)],
                                  Annotated[TokenizeChatRequest, Tag(CHAT)]], Discriminator(_kind)]


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]

    def refusal(self) -> tuple[str, str] | None:
        """(field, message) for an id that cannot travel as INT64, else None (the orchestrator checks the
        vocabulary)."""
        bad = next((i for i in self.tokens if not 0 <= i < TOKEN_ID_LIMIT), None)
        return None if bad is None else ("tokens", f"tokens: token id {shown(bad)} is not in [0, 2**63)")


class TokenizeResponse(BaseModel):
    """``count`` tokens, the ids in ``tokens``; ``max_model_len`` the served model's context (tokens);
    ``token_strs`` each id's token string where ``return_token_strs`` asked, else null."""

    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="the text the token ids decode to")
