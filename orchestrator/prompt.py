"""The prompt: chat template, visual-token expansion, and where each group's tokens sit (or a text prompt as it
is, without the chat template).

The visual-token count of each item comes from metadata alone (flashcodec's probe + the model family's plan), before
any frame is decoded: a group of h x w patches becomes ``h*w / merge**2`` tokens (Qwen2.5-VL: ``merge_size`` 2,
transformers' ``Qwen2VLImageProcessor``; InternVL3: pixel shuffle 0.5, 256 tokens a tile). What surrounds them in the
prompt is the family's (``flashcodec.families``: ``expand``).
"""
from __future__ import annotations

import functools
import itertools
import json
import re
import threading
from dataclasses import dataclass

import jinja2

from flashcodec.families import Family, family
from orchestrator.chat_options import ChatOptions
from orchestrator.content_format import AUTO, STRING, chosen_format, string_content
from orchestrator.messages import Turn, user_turn
from orchestrator.sampling_params import InvalidInput

MERGE = 2  # patches per token side: Qwen2.5-VL's spatial_merge_size, InternVL3's pixel shuffle (0.5)
# Stands for message text k while the template is applied (NUL bytes: no template writes them).
TEXT_MARK = "\x00unifiedserve-text-{}\x00"
_TEXT_MARK_RE = re.compile("\x00unifiedserve-text-(\\d+)\x00")
# transformers' encode(split_special_tokens=...) sets that flag on the tokenizer's one shared Rust object, and
# prompts are built in worker threads: unserialised, a template's "<|image_pad|>" can be split into text.
_ENCODE_LOCK = threading.Lock()
_CACHED_PIECE = 16_384  # characters of a template piece whose ids are cached (_template_ids)
QWEN = family("qwen2_5_vl")


@dataclass(frozen=True)
class MediaLayout:
    """One image or video in the prompt. ``grid_thw`` (groups, h, w) in patches; ``group_offsets``: the position
    of each group's first visual token (a group's tokens are contiguous; groups need not be: InternVL3 writes
    ``Frame{i}:`` text between a video's frames)."""

    kind: str
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float
    group_offsets: tuple[int, ...]

    @property
    def token_offset(self) -> int:
        """The position of the item's first visual token."""
        return self.group_offsets[0]

    @property
    def tokens_per_group(self) -> int:
        return self.grid_thw[1] * self.grid_thw[2] // (MERGE * MERGE)

    @property
    def patches_per_group(self) -> int:
        return self.grid_thw[1] * self.grid_thw[2]

    @property
    def num_groups(self) -> int:
        """Temporal-patch groups (2 frames each; an image is one group)."""
        return self.grid_thw[0]

    @property
    def num_tokens(self) -> int:
        return self.num_groups * self.tokens_per_group


@dataclass(frozen=True)
class Prompt:
    input_ids: tuple[int, ...]
    media: tuple[MediaLayout, ...]

    @property
    def num_visual_tokens(self) -> int:
        return sum(m.num_tokens for m in self.media)

    def check_length(self, max_tokens: int, max_model_len: int, family: Family = QWEN) -> None:
        """Refuses a request whose prompt plus ``max_tokens`` output tokens exceed ``max_model_len`` tokens.

        Raises InvalidInput naming what to change: ``max_tokens`` (with the largest value that fits) when the
        prompt leaves room for output, else the prompt (when it has visual tokens, the settings of ``family`` that
        lower them: ``Family.fewer_tokens``, e.g. fps / max_pixels).
        """
        n, visual = len(self.input_ids), self.num_visual_tokens
        if n + max_tokens <= max_model_len:
            return
        counts = f"{n - visual} text tokens + {visual} visual tokens"
        kinds = {m.kind for m in self.media}
        video = "video" in kinds
        knobs = " or ".join(dict.fromkeys(k for kind in ("video", "image") if kind in kinds
                                          for k in family.fewer_tokens[kind]))
        fewer_visual = f" (lower {knobs} for fewer visual tokens)" if visual else ""
        if n < max_model_len:
            raise InvalidInput(
                f"sampling_parameters: max_tokens {max_tokens} plus the prompt's {n} tokens ({counts}) exceeds "
                f"max_model_len {max_model_len}: max_tokens can be at most {max_model_len - n}{fewer_visual}")
        room = max_model_len - (n - visual) - 1  # visual tokens that would leave one token of output
        fewer = f"lower {knobs}, or send a shorter clip" if video else f"lower {knobs}, or send fewer images"
        fix = f"at most {room} visual tokens fit: {fewer}" if visual and room > 0 else "shorten the prompt"
        raise InvalidInput(f"prompt too long: its {n} tokens ({counts}) leave no room for output within "
                           f"max_model_len {max_model_len} ({fix})")


def build_prompt(tokenizer, text: str, media: list[tuple[str, tuple[int, int, int], float]],
                 family: Family = QWEN) -> Prompt:
    """The prompt of one user turn: its images, then its videos, then ``text`` (the ``text_input`` request).

    ``media``: (kind, grid_thw in patches, second_per_grid_t in seconds; 0 for images), in prompt order.
    """
    return build_chat_prompt(tokenizer, (user_turn(text, [kind for kind, _, _ in media]),), media, family)


def build_chat_prompt(tokenizer, turns: tuple[Turn, ...], media: list[tuple[str, tuple[int, int, int], float]],
                      family: Family = QWEN, options: ChatOptions = ChatOptions(), content: str = AUTO) -> Prompt:
    """Apply the model's chat template to a conversation (then, by default, the assistant's turn: ``options``) and
    put each media item's text and visual tokens in place of its placeholder (``family.expand``: the text its
    processor writes there).

    ``media``: (kind, grid_thw in patches, second_per_grid_t in seconds; 0 for images), one per placeholder of
    ``turns``, in the same order. Each run of visual tokens is tokenized as one special token and then repeated (the
    ids equal tokenizing the processor's text, without tokenizing thousands of pads). The tools and the messages'
    tool calls are the template's to write (``orchestrator.template_data``); ``content``: how the template takes a
    message's content (``orchestrator.content_format.chosen_format``). A text the template leaves out (a
    server template that skips system messages) is left out; one it writes twice is written twice. Raises
    InvalidInput when they or the template's variables hold a token only the server places, the template raises
    (its ``raise_exception``: the conversation is the client's) or writes no placeholder for a kind of ``media`` (a
    template for images only, as a server's own may be), RuntimeError when the template changes a text's mark
    (it writes texts through a filter) or drops, repeats or reorders a placeholder.
    """
    _refuse_placed_tokens(turns, options, family)
    texts = [part.text for turn in turns for part in turn.parts if part.kind == "text"]
    templated = templated_text(tokenizer, tuple((turn.role, tuple(part.kind for part in turn.parts), turn.fields)
                                                for turn in turns), options, family, content)
    _refuse_unplaced_kinds(media, templated, family)
    pieces = _TEXT_MARK_RE.split(templated)  # template, text index, template, text index, ..., template
    if any("\x00" in piece for piece in pieces[::2]):
        raise RuntimeError("the chat template changed a message's text as it wrote it (a filter on the text?): the "
                           "server's template must write each text part as it is")
    kinds = {token: kind for kind, token in family.placeholders.items()}
    placeholder_re = re.compile("|".join(map(re.escape, kinds)))
    pending = list(media)
    runs: list[tuple[int, int, int]] = []  # (media item, token id, run length), in prompt order

    def expand(match: re.Match) -> str:
        if not pending or kinds[match.group()] != pending[0][0]:
            raise RuntimeError(f"the chat template wrote {match.group()} where the media order has "
                               f"{pending[0][0] if pending else 'none left'}")
        kind, grid, _ = pending.pop(0)
        expansion = family.expand(kind, tuple(grid))
        token = tokenizer.convert_tokens_to_ids(expansion.token)
        runs.extend((len(media) - len(pending) - 1, token, n) for n in expansion.runs)
        return expansion.text

    # Message texts are tokenized on their own with special-token strings split into plain text, so a
    # prompt cannot inject "<|im_end|>" or a "<|video_pad|>" that no media backs.
    ids: list[int] = []
    with _ENCODE_LOCK:
        for k, piece in enumerate(pieces):
            if k % 2:
                ids += tokenizer.encode(texts[int(piece)], add_special_tokens=False, split_special_tokens=True)
            else:
                ids += _template_ids(tokenizer, placeholder_re.sub(expand, piece))
    if pending:
        raise RuntimeError(f"the chat template dropped {len(pending)} media placeholders")
    return Prompt(*_place_runs(ids, runs, media))


Shape = tuple[tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]], ...]  # (role, part kinds, fields) a message


def _refuse_unplaced_kinds(media: list, templated: str, family: Family) -> None:
    """Raises InvalidInput where the ``templated`` conversation has no placeholder at all for a kind of its
    ``media`` (a server template for images only, asked about a video): the server cannot take that kind in a chat."""
    for kind in dict.fromkeys(item[0] for item in media):
        if family.placeholders[kind] not in templated:
            raise InvalidInput(f"messages: this server's chat template (the launcher's --chat-template) writes no "
                               f"placeholder for a {kind} ({family.placeholders[kind]}), so it cannot take a {kind} "
                               f"in a message; send it to a server whose template places {kind}s")


def templated_text(tokenizer, shape: Shape, options: ChatOptions, family: Family = QWEN,
                   content: str = AUTO) -> str:
    """The chat template applied as ``options`` say to the conversation of ``shape`` (message text k written as
    ``TEXT_MARK`` k: with ``continue_final_message`` the text ends at the last mark, so the final text is tokenized
    whole), each content a list of parts or, for a template that takes it as one string, that string
    (``orchestrator.content_format.chosen_format`` of ``content``, its media parts ``family.part_texts``); cached
    unless the template reads the clock (``strftime_now``) or the request has tools or tool calls (an agent's tool
    list, tens of KiB, would make each cached prompt as large)."""
    uncached = "strftime_now" in (tokenizer.chat_template or "") or options.tools or any(f for _, _, f in shape)
    part_texts = tuple(family.part_texts.items())
    try:
        return (_templated_shape.__wrapped__ if uncached else _templated_shape)(tokenizer, shape, options, part_texts,
                                                                                 content)
    except jinja2.TemplateSyntaxError:  # the server's template is broken: not the client's error
        raise
    except jinja2.TemplateError as exc:
        raise InvalidInput(f"messages: the chat template refused the conversation ({exc})") from None


@functools.lru_cache(maxsize=256)
def _templated_shape(tokenizer, shape: Shape, options: ChatOptions, part_texts: tuple[tuple[str, str], ...],
                     content: str) -> str:
    texts = itertools.count()
    contents = [[(kind, TEXT_MARK.format(next(texts)) if kind == "text" else "") for kind in kinds]
                for _, kinds, _ in shape]
    if chosen_format(tokenizer.chat_template, content) == STRING:
        contents = [string_content(parts, dict(part_texts)) for parts in contents]
    else:
        contents = [[{"type": "text", "text": text} if kind == "text" else {"type": kind} for kind, text in parts]
                    for parts in contents]
    conversation = [{"role": role, "content": content, **{name: json.loads(value) for name, value in fields}}
                    for (role, _, fields), content in zip(shape, contents)]
    return tokenizer.apply_chat_template(conversation, tools=json.loads(options.tools) if options.tools else None,
                                         tokenize=False, add_generation_prompt=options.add_generation_prompt,
                                         continue_final_message=options.continue_final_message,
                                         **options.kwargs_for(tokenizer.chat_template or ""))


def _refuse_placed_tokens(turns: tuple[Turn, ...], options: ChatOptions, family: Family) -> None:
    """Raises InvalidInput where the tools (``chat_template_kwargs: tools``), the template's variables or a message's
    fields (``messages[i].tool_calls``) hold one of ``family.reserved_tokens``: the template writes them as they are,
    and the prompt's media are placed by those tokens."""
    data = [("chat_template_kwargs: tools", options.tools or "")]
    data += [(f"chat_template_kwargs: {name}", value) for name, value in options.template_kwargs]
    data += [(f"messages[{i}].{name}", text) for i, turn in enumerate(turns) for name, text in turn.fields]
    for where, text in data:
        if found := [token for token in family.reserved_tokens if token in text]:
            raise InvalidInput(f"{where}: holds {found[0]}, which only the server places")


def _template_ids(tokenizer, piece: str) -> list[int]:
    """The ids of a piece of the template's text (media expansions in it), cached: the same pieces come back in every
    prompt of a shape; one of over ``_CACHED_PIECE`` characters (the tools, tool calls: tens of KiB) is not. Called
    under ``_ENCODE_LOCK``; the caller copies the list it gets (``ids += ...``)."""
    if len(piece) > _CACHED_PIECE:
        return tokenizer.encode(piece, add_special_tokens=False)
    return _cached_ids(tokenizer, piece)


@functools.lru_cache(maxsize=1024)
def _cached_ids(tokenizer, piece: str) -> list[int]:
    return tokenizer.encode(piece, add_special_tokens=False)


def _place_runs(ids: list[int], runs: list[tuple[int, int, int]], media: list[tuple[str, tuple[int, int, int], float]]
                ) -> tuple[tuple[int, ...], tuple[MediaLayout, ...]]:
    """``ids`` with each run's one token repeated to the run's length, and each item's layout (its groups' first
    tokens: a group lies within one run)."""
    out: list[int] = []
    positions: list[list[int]] = [[] for _ in media]  # each item's visual-token positions
    pending = iter(runs)
    item, token, length = next(pending, (-1, -1, 0))
    for i in ids:
        if i != token:
            out.append(i)
            continue
        positions[item].extend(range(len(out), len(out) + length))
        out.extend([token] * length)
        item, token, length = next(pending, (-1, -1, 0))
    layouts = []
    for (kind, grid, spg), where in zip(media, positions):
        per_group = grid[1] * grid[2] // (MERGE * MERGE)
        starts = tuple(where[g * per_group] for g in range(grid[0]))
        if len(where) != grid[0] * per_group or any(where[s + per_group - 1] - where[s] != per_group - 1
                                                    for s in range(0, len(where), per_group)):
            raise RuntimeError(f"a {kind}'s visual tokens do not form its {grid[0]} groups of {per_group}")
        layouts.append(MediaLayout(kind, tuple(grid), float(spg), starts))
    return tuple(out), tuple(layouts)


def build_raw_prompt(tokenizer, text: str, family: Family = QWEN) -> Prompt:
    """A text prompt tokenized as it is, without the chat template (OpenAI's completions, the vLLM backend's
    ``text_input``): special tokens written in it (``<|im_start|>``) are special tokens, as in vLLM's completions
    (``add_special_tokens=True``, which adds nothing for Qwen's tokenizer). Raises InvalidInput when it holds one of
    ``family.reserved_tokens`` (the media tokens only the server places)."""
    with _ENCODE_LOCK:
        ids = tokenizer.encode(text, add_special_tokens=True)
    _refuse_media_tokens("prompt", ids, tokenizer, family)
    return Prompt(tuple(ids), ())


def build_token_prompt(tokenizer, ids: tuple[int, ...], vocabulary: int, family: Family = QWEN,
                       reserved_ok: bool = False) -> Prompt:
    """A prompt given as token ids (the ``prompt_token_ids`` input, vLLM's ``TokensPrompt``), taken as it is.
    Raises InvalidInput (naming ``prompt_token_ids``) for no ids, an id outside ``[0, vocabulary)`` (the ids both the
    tokenizer and the model know: ``families.registry.sampled_ids``), or, unless ``reserved_ok`` (a prompt that is
    only decoded to text: ``tokenize_only``), one of ``family.reserved_tokens``."""
    if not ids:
        raise InvalidInput("prompt_token_ids: the prompt is empty")
    bad = next((k for k, i in enumerate(ids) if not 0 <= i < vocabulary), None)
    if bad is not None:
        raise InvalidInput(f"prompt_token_ids: id {ids[bad]} (position {bad}) is outside the vocabulary, "
                           f"[0, {vocabulary})")
    if not reserved_ok:
        _refuse_media_tokens("prompt_token_ids", ids, tokenizer, family)
    return Prompt(tuple(ids), ())


def token_prompt_text(tokenizer, ids: list[int]) -> str:
    """A ``prompt_token_ids`` prompt's text (vLLM's ``/detokenize``): ``tokenizer.decode(ids)``, special tokens kept,
    through the tokenizers library's ``decode_batch``, which releases the GIL while it decodes; ``decode`` holds it.
    On the CPU machine 1,000,000 ids took 185 ms in ``decode``, a thread beside it waiting up to 115 ms for the GIL
    (in the orchestrator: every stream's tokens), and 102 ms in ``decode_batch``, the thread waiting at most 7 ms; the
    same text. A tokenizer that cleans up spaces after decoding (``clean_up_tokenization_spaces``, transformers'
    Python after the library's decode; not Qwen's) goes through ``decode``."""
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.decode(ids)
    return tokenizer.backend_tokenizer.decode_batch([ids], skip_special_tokens=False)[0]


def _refuse_media_tokens(name: str, ids, tokenizer, family: Family) -> None:
    """Raises InvalidInput naming input ``name`` when ``ids`` hold one of ``family.reserved_tokens``."""
    reserved = dict(zip(tokenizer.convert_tokens_to_ids(list(family.reserved_tokens)), family.reserved_tokens))
    found = sorted({reserved[i] for i in ids if i in reserved})
    if found:
        raise InvalidInput(f"{name}: holds {', '.join(found)}, which only the server places (send images and videos "
                           "in a chat: the OpenAI API's /v1/chat/completions with image_url or video_url parts, or "
                           "Triton's text_input or messages inputs)")
