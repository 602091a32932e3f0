"""Every message between the orchestrator and the stages, defined once (both sides import this module).

Frozen dataclasses, pickled over the stage link (``backends.ipc.link``); no torch, so the orchestrator's
scheduler and engine use them directly. Only page indices and small values travel: tensors stay in the
shared pools (``backends.ipc.shared_tensor``).

Calls (``Call`` subclasses, sent by the orchestrator) and their replies:

==================  ============  ==========================================================================
call                stage         replies, then the call's end
==================  ============  ==========================================================================
``StepPlan``        encode_prefill  one ``StepResult``
``DecodeAttach``    decode        ``None`` once attached, then one ``DecodeStep`` per decode step, for good
``DecodeAdmit``     decode        none (the sequence joins the next step)
``DecodeAbort``     decode        none; the end comes once the loop no longer touches the sequence's KV pages
``MediaDecode``     flashcodec    one ``GroupReady`` per temporal-patch group, as soon as its patches are in
                                  the pool
``MediaAbort``      flashcodec    none (the request's ``MediaDecode`` calls end after their current group)
==================  ============  ==========================================================================

A call that fails ends with a ``StageFailure``, whose ``kind`` says whether the stage blames the request
(``invalid_input``: e.g. a video that will not decode) or itself (``server_fault``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # annotations only: this module imports nothing of flashcodec at run time
    from flashcodec.families import MediaPlan

# The KV pool's last page is the decode runtime's scratch page (CUDA-graph padding rows write there): the
# orchestrator grants pages 0 .. num_pages - 1 - RESERVED_KV_PAGES of a pool of num_pages.
RESERVED_KV_PAGES = 1

INVALID_INPUT = "invalid_input"
SERVER_FAULT = "server_fault"
MAX_LOGPROBS = 20  # the most top tokens a sampled token's log probabilities come with (vLLM's max_logprobs)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value's bound either way (OpenAI's API's)
STRUCTURED_KINDS = ("json", "json_object", "regex", "grammar")
NO_MATCH = "no_match"  # a finish reason: the structured output's grammar allows no token after the output so far


@dataclass(frozen=True)
class StructuredOutput:
    """What an output must match (vLLM's ``structured_outputs``), as ``backends.runtime.sampling.grammar`` compiles
    it with xgrammar: ``kind`` "json" (``text``: a JSON schema), "json_object" (any JSON object; ``text`` empty),
    "regex" (``text``: a regular expression) or "grammar" (``text``: EBNF, xgrammar's dialect; a list of choices
    arrives as one); ``any_whitespace``: JSON may hold any whitespace between its tokens (else none beyond one
    space after ``:`` and ``,``, vLLM's ``disable_any_whitespace``)."""

    kind: str
    text: str = ""
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")

    def __repr__(self) -> str:  # as messages show it: its kind and its text's start
        text = self.text if len(self.text) <= 40 else f"{self.text[:40]}... ({len(self.text)} characters)"
        return f"{{{self.kind}: {text!r}}}"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, as both stages that sample apply it (``backends.runtime.sampling.sampler`` and
    ``backends.runtime.sampling.penalties``). Raises ValueError for values out of range (vLLM's ranges).

    * ``temperature``: 0 (or below the sampler's ``GREEDY_BELOW_TEMPERATURE``, 1e-5 as in vLLM) means greedy
      (argmax); otherwise logits are divided by it (a temperature beyond float32's range acts as float32's
      largest). Top-k and top-p compare tokens by logit, so they keep what they would at any temperature.
    * ``top_p``: keep each token whose strictly more likely tokens hold less than ``top_p`` of the probability:
      the smallest set of most likely tokens that reaches ``top_p``, and every token tied with its last
      (1 = off).
    * ``top_k``: keep the ``top_k`` most likely tokens and every token tied with the k-th (0 = off).
    * ``min_p`` (in [0, 1], 0 = off): keep the tokens at least ``min_p`` times as likely as the most likely one at
      this temperature (vLLM's ``min_p``: applied before top-k and top-p, which then see only what it kept).
    * ``seed``: makes the draw reproducible (``None``: a fresh random seed for every draw).
    * ``min_tokens``: eos ids and ``stop_token_ids`` are masked while fewer tokens than this have been generated.
    * ``ignore_eos``: eos does not end the request (the stop rule's, ``backends.runtime.sampling.stopping``);
      ``stop_token_ids`` still do.
    * ``repetition_penalty`` (> 0, 1 = off): logits of tokens in the prompt or the output so far are divided by
      it where positive, multiplied by it otherwise (vLLM's, as transformers' ``RepetitionPenaltyLogitsProcessor``).
    * ``presence_penalty``, ``frequency_penalty`` (in [-2, 2], 0 = off): ``logits -= presence * (count > 0) +
      frequency * count``, ``count`` being each token's occurrences in the output so far (vLLM's, after
      OpenAI's definition).
    * ``stop_token_ids``: token ids that end the sequence as eos does (finish reason ``"stop"``), distinct.
    * ``logprobs``: with each sampled token, its log probability and rank and those of the ``logprobs`` most likely
      tokens (0: the sampled token's alone; None: none computed; at most :data:`MAX_LOGPROBS`, vLLM's default
      ``max_logprobs``): ``backends.runtime.sampling.logprobs``.
    * ``logit_bias``: ``(token id, bias)`` pairs, each bias (in [-100, 100]) added to that token's logit before the
      penalties and sampling, as vLLM v1 orders them (OpenAI's ``logit_bias``; not in the log probabilities, which are
      the raw logits'); ids distinct: ``backends.runtime.sampling.logit_bias``.
    * ``prompt_logprobs``: the log probability and rank of each prompt token after the first under the model's raw
      distribution at the position before it, and those of the ``prompt_logprobs`` most likely tokens there (0: the
      prompt token's alone; None: none computed; at most :data:`MAX_LOGPROBS`): vLLM's ``prompt_logprobs``, computed
      in prefill over every position of the prompt (``backends.runtime.sampling.logprobs.prompt_figures``).
    * ``structured``: the output must match it (``StructuredOutput``): tokens that cannot continue a match are
      masked before sampling, and the output ends once the match is whole and an eos token sampled (the only tokens
      allowed then); ``min_tokens`` must be 0 beside it (it would mask those eos tokens).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None
    prompt_logprobs: int | None = None
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(t < 0 for t in self.stop_token_ids) or len(set(self.stop_token_ids)) != len(self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be distinct ids >= 0, got {self.stop_token_ids}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        ids = [t for t, _ in self.logit_bias]
        if any(t < 0 for t in ids) or len(set(ids)) != len(ids) or any(
                not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias):
            raise ValueError(f"logit_bias must map distinct ids >= 0 to biases in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}], got {self.logit_bias}")
        if self.structured is not None and self.min_tokens:
            raise ValueError(f"min_tokens must be 0 with a structured output, got {self.min_tokens}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the stages keep token counts for such sequences only)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


class Call:
    """A message that starts a stage-link call (the link sends its subclasses only)."""


@dataclass(frozen=True)
class StageFailure:
    """How a failed call ends: ``kind`` is ``invalid_input`` (the request is at fault: the client gets
    INVALID_ARG) or ``server_fault``; ``message`` names the problem for the client."""

    kind: Literal["invalid_input", "server_fault"]
    message: str

    def __post_init__(self) -> None:
        if self.kind not in (INVALID_INPUT, SERVER_FAULT):
            raise ValueError(f"StageFailure.kind must be {INVALID_INPUT} or {SERVER_FAULT}, got {self.kind!r}")


# ---- encode_prefill: one call per scheduler step -------------------------------------------------------


@dataclass(frozen=True)
class MediaGrid:
    """One media item of a prompt: ``kind`` image | video, ``grid_thw`` (groups, h, w) in patches before the 2x2
    merge (a family's ``MediaPlan.grid_thw``, ``flashcodec.families``: Qwen2.5-VL's temporal patches, InternVL3's
    448-pixel tiles), ``second_per_grid_t`` seconds per group (Qwen2.5-VL's videos: M-RoPE's time axis; else 0)."""

    kind: str
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float = 0.0


@dataclass(frozen=True)
class NewRequest:
    """A request the encode_prefill stage has not seen: its prompt ``input_ids`` (visual tokens expanded),
    its media in prompt order, and its sampling for the first token (``max_tokens`` for the stop rule);
    ``cached_embeds``: (first token, key) of each media group whose embeddings the stage keeps in its encoder cache
    (``orchestrator.encoder_cache``), to copy into the prompt's rows."""

    req_id: str
    input_ids: tuple[int, ...]
    media: tuple[MediaGrid, ...]
    sampling: SamplingParams
    max_tokens: int
    cached_embeds: tuple[tuple[int, bytes], ...] = ()


@dataclass(frozen=True)
class EncodeWork:
    """Run the vision encoder on group ``index`` of media item ``item`` of ``req_id``, whole: ``num_patches``
    patches (before the 2x2 merge) stored in order over ``patch_pages`` of the patch pool; its embeddings go to
    the prompt rows from ``token_offset`` on, and are kept in the encoder cache under ``cache_key`` when set."""

    req_id: str
    item: int
    index: int
    patch_pages: tuple[int, ...]
    num_patches: int
    token_offset: int
    cache_key: bytes | None = None


@dataclass(frozen=True)
class PrefillWork:
    """Prefill prompt tokens [start, end) of ``req_id``, writing their KV into ``block_table``'s pages.
    ``is_last``: the chunk ends the prompt, so the stage samples the first output token."""

    req_id: str
    start: int
    end: int
    block_table: tuple[int, ...]
    is_last: bool


@dataclass(frozen=True)
class StepPlan(Call):
    """One scheduler step, the whole of it (vLLM v1's ``SchedulerOutput``): the stage first forgets ``finished``
    (requests that ended, failed or were cancelled after it saw them) and the encoder-cache keys in ``evict``,
    registers ``new``, runs all of ``encode``, then all of ``prefill``. ``num_encode_patches`` and
    ``num_prefill_tokens`` are the totals. ``fewer_sms``: the stage runs the step on fewer SMs where it has a green
    context (``backends.stages.step_streams``); the orchestrator sets it (``orchestrator.fewer_sms``)."""

    new: tuple[NewRequest, ...]
    encode: tuple[EncodeWork, ...]
    prefill: tuple[PrefillWork, ...]
    finished: tuple[str, ...] = ()
    evict: tuple[bytes, ...] = ()
    fewer_sms: bool = False
    num_encode_patches: int = field(init=False)
    num_prefill_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_encode_patches", sum(w.num_patches for w in self.encode))
        object.__setattr__(self, "num_prefill_tokens", sum(w.end - w.start for w in self.prefill))


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log probability (natural log, under the model's raw distribution:
    ``backends.runtime.sampling.logprobs``), its ``rank`` there (1: the most likely) and the ``top`` most likely
    tokens as ``(token id, log probability)``, most likely first (``SamplingParams.logprobs`` of them)."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """A prompt's log probabilities (``SamplingParams.prompt_logprobs``): per prompt token after the first, in order,
    ``2 + 2 * top`` float32 figures (native byte order) in ``figures``: the token's log probability and rank at the
    position before it, then the ``top`` most likely token ids there and their log probabilities (most likely
    first), as ``backends.runtime.sampling.logprobs.prompt_figures`` makes them. Bytes, not objects: a 100,000-token
    prompt's pickle stays one buffer."""

    figures: bytes
    top: int


@dataclass(frozen=True)
class FirstToken:
    """A prompt's first output token, sampled where its prefill ended; ``finish_reason`` by the stop rule
    (``"stop"``, ``"length"``, or ``""`` to go on in decode); ``mrope_delta``: the offset of the decode positions
    (token ``p`` at position ``p + mrope_delta``; the family's ``prompt_positions``: M-RoPE's for Qwen2.5-VL, 0 for
    1-D RoPE families such as InternVL3)."""

    req_id: str
    token: int
    mrope_delta: int
    finish_reason: str
    logprobs: TokenLogprobs | None = None  # when its SamplingParams.logprobs asks
    prompt_logprobs: PromptLogprobs | None = None  # when its SamplingParams.prompt_logprobs asks


@dataclass(frozen=True)
class StepResult:
    """A step's first tokens, and ``worker_ms``: the worker's host time for the step (ms; it includes the device's
    time where the step waits for the device: an encode, or a sampled first token); ``encode_ms`` and
    ``prefill_ms``: the device's time for the step's encode and its prefill (first-token sampling included), where
    the step waited for the device anyway, else None (a prefill-only step that ends no prompt is not waited for)."""

    first_tokens: tuple[FirstToken, ...]
    worker_ms: float = 0.0
    encode_ms: float | None = None
    prefill_ms: float | None = None


# ---- decode ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeAttach(Call):
    """Open the decode stage's step stream (one per orchestrator; a new one replaces the old)."""


@dataclass(frozen=True)
class DecodeAdmit(Call):
    """A sequence whose prefill is done joins the decode batch: its KV pages (``block_table``), the tokens in
    them (``num_cached``), its first token (not yet in the pool), and the counts for the stop rule.
    ``prompt_token_ids``: the prompt's distinct token ids, sorted, for ``sampling.repetition_penalty`` != 1 (else
    empty: a video prompt holds thousands of tokens, its distinct ids far fewer)."""

    seq_id: str
    block_table: tuple[int, ...]
    num_cached: int
    last_token: int
    mrope_delta: int  # decode positions: token p at p + mrope_delta (FirstToken's; 0 for 1-D RoPE families)
    num_generated: int
    max_tokens: int
    sampling: SamplingParams
    prompt_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class DecodeAbort(Call):
    seq_id: str


@dataclass(frozen=True)
class DecodeGrow(Call):
    """More KV pages for sequences in decode (``orchestrator.kv_growth``): ``grants`` holds (seq_id, pages to append
    to its block table), sent after its ``DecodeAdmit``. Decode skips a sequence in its steps while the next
    token's KV has no page; one it no longer holds is ignored (the orchestrator frees its pages)."""

    grants: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class DecodePace(Call):
    """Space the decode loop's step launches at least ``interval_ms`` apart (ms; 0: none spaced), each step read
    before the next is launched, for at most ``for_ms`` from its arrival (ms; 0 ends the pacing; a pacing not ended
    by then ends itself): sent while an encode/prefill step that ends image prompts, or more prompts than decode
    holds, runs, so that step gets more of the GPU, and (interval 0, ``serial_joins``) while one ends prompts beside
    decode, so that their sequences join decode's next launch (``orchestrator.decode_pace``)."""

    interval_ms: float
    for_ms: float = 0.0


@dataclass(frozen=True)
class DecodeStep:
    """One decode step's tokens for all sequences in it: row i is ``seq_ids[i]``'s ``token_ids[i]`` with its
    ``finish_reasons[i]`` (``""`` running, ``"stop"``, ``"length"``, or ``"error"``: the step failed and the
    sequence is dropped, its token meaningless). A sequence's last row comes once no step writes its pages.
    ``launched_s`` and ``read_s``: when the step was launched on the device and its tokens read on the host
    (``time.monotonic()`` seconds, comparable across the host's processes; 0.0: not measured, e.g. a failed step's
    rows; a last row held back for the step after its own comes with that step's), for request timelines
    (``orchestrator.timeline``)."""

    seq_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    finish_reasons: tuple[str, ...]
    launched_s: float = 0.0
    read_s: float = 0.0
    logprobs: tuple[TokenLogprobs | None, ...] = ()  # per row where any asked (SamplingParams.logprobs), else ()


# ---- flashcodec -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MediaDecode(Call):
    """Decode one media item of ``req_id`` by ``plan`` (a family's image or video plan,
    ``flashcodec.families.MediaPlan``: its ``family`` says whose rules decode it) from ``path`` (checked by the
    orchestrator, ``stamp``: the file then, ``flashcodec.files.file_stamp``) when set, else from ``data`` (bytes)."""

    req_id: str
    plan: MediaPlan
    data: bytes | None = None
    path: str | None = None
    stamp: tuple[int, ...] | None = None


@dataclass(frozen=True)
class MediaAbort(Call):
    req_id: str


@dataclass(frozen=True)
class GroupReady:
    """Temporal-patch group ``index`` is in ``pages`` of the patch pool; from now on those pages are the
    orchestrator's to return."""

    index: int
    pages: tuple[int, ...]
