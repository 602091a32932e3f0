"""A request's outputs as its client sees them (vLLM v1's ``OutputProcessor``): detokenizing, stop strings and
cancellation, next to the frontend.

The engine queues each token with the finish reason of the stage that sampled it (eos, ``max_tokens``);
this module turns them into text deltas, ends the output at a stop string, and ends it with ``"abort"`` when
the client's cancellation reaches the request's queue (:meth:`OutputProcessor.cancel`, which the frontend's cancel
watch has the event loop call). Either of those ends the request early, so it is aborted in its engine (which
returns its pages once the stages have let go of them). Tokens that queued up while the request's handler was busy
leave in one item (one client response for them, not one each), with the same ids and text as one by one.
"""
from __future__ import annotations

import asyncio
import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, NamedTuple, Sequence

from backends.ipc.link import StageError
from backends.ipc.protocol import INVALID_INPUT, PromptLogprobs, TokenLogprobs
from orchestrator.detokenizer import Detokenizer
from orchestrator.engine import Engine
from orchestrator.engine_io import Output
from orchestrator.sampling_params import InvalidInput, RequestParams

CANCELLED = Output(finish_reason="abort")  # what cancel() queues: the stream ends with "abort" when it comes to it
MIN_LOGPROB = -9999.0  # a log probability's floor in the entries (vLLM's OpenAI server's): JSON has no -inf or NaN


class Piece(NamedTuple):
    """One item of a request's output stream: the ``text`` delta, the ``ids`` it brings, the finish ``reason``
    (None: more follow); where the request asked for log probabilities, ``logprobs``, one entry per id (the vLLM
    backend's ``logprobs`` output: ``{"<id>": {"logprob", "rank", "decoded_token"}}``, the sampled token first, then
    the top tokens) and ``cumulative_logprob``, the sum of the output's token log probabilities so far; on the first
    item of a request that asked for them (``prompt_logprobs``), ``prompt_logprobs``: the JSON text of a list with one
    entry per prompt token, as above (vLLM's ``RequestOutput.prompt_logprobs``, whose first is None), the first
    token's with its text alone (it follows nothing: its ``logprob`` and ``rank`` are null). On the last item,
    ``stop_reason`` (vLLM's): the stop string that ended the output, or the id of the stop token that did when that
    is not the tokenizer's eos token (a ``stop_token_ids`` token, Qwen's ``<|endoftext|>``), else None."""

    text: str
    ids: list[int]
    reason: str | None
    logprobs: tuple[dict, ...] = ()
    cumulative_logprob: float = 0.0
    prompt_logprobs: str | None = None
    stop_reason: int | str | None = None


class OutputProcessor:
    """Per-request output streams over one ``tokenizer`` (``decode(ids, skip_special_tokens=True)``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # token id -> its text alone (logprobs entries; at most the vocabulary)
        self._quoted: dict[int, str] = {}  # token id -> that text as a JSON string (prompt_logprobs' entries)
        # prompts' entries written one after another: each such thread beside the event loop takes a share of its
        # time (the GIL), and the loop sends every stream's tokens (bench/results/big-reply-stall-cpu-2026-12-05/)
        self._bulk = ThreadPoolExecutor(1, "prompt-logprobs")

    @staticmethod
    def cancel(outputs: asyncio.Queue) -> None:
        """End the stream reading ``outputs`` with ``"abort"`` after the outputs queued already; on the event
        loop."""
        outputs.put_nowait(CANCELLED)

    async def stream(self, engine: Engine, req_id: str, outputs: asyncio.Queue, params: RequestParams,
                     prompt_ids: Sequence[int] = ()) -> AsyncIterator[Piece]:
        """Yield :class:`Piece` s as tokens arrive from ``outputs`` (the request's queue in ``engine``); the last
        has a finish reason: the stage's (``"stop"``: an eos or stop token, whose id is out but not its text unless
        ``include_stop_str_in_output``, as vLLM v1's detokenizer skips it), ``"stop"`` for a stop string (the text
        ends before it, or after it with ``include_stop_str_in_output``), or ``"abort"`` (no tokens) once
        :meth:`cancel` reached it, after the tokens queued before. However it ends (a consumer that stops early
        too), the request is aborted in ``engine``. ``prompt_ids``: the prompt, whose entries the first item's
        ``prompt_logprobs`` gives where the request asked (built on a worker thread: a long prompt's are millions of
        objects, which the event loop would stall on).

        Raises InvalidInput or StageError when a stage failed the request, after the tokens before the failure.
        """
        detok = Detokenizer(self.tokenizer, params.stop, params.min_tokens, params.include_stop_str_in_output,
                            params.skip_special_tokens)
        cumulative, prompt = 0.0, None
        try:
            while True:
                output = await outputs.get()
                if output.prompt_logprobs is not None:  # the first token's
                    prompt = await asyncio.get_running_loop().run_in_executor(
                        self._bulk, self._prompt_json, prompt_ids, output.prompt_logprobs)
                deltas, ids, entries = [], [], []
                # this token and those queued behind it
                while output is not None and output is not CANCELLED and output.failure is None:
                    # the eos or stop token that ended the output: its id out, its text not (vLLM's rule)
                    if output.finish_reason != "stop" or params.include_stop_str_in_output:
                        deltas.append(detok.add([output.token]))
                    ids.append(output.token)
                    if output.logprobs is not None:
                        entries.append(self._entry(output.token, output.logprobs))
                        cumulative += entries[-1][str(output.token)]["logprob"]
                    reason = "stop" if detok.stopped else output.finish_reason
                    if reason:
                        yield Piece("".join(deltas) + detok.flush(), ids, reason, tuple(entries), cumulative, prompt,
                                    self._stop_reason(detok, output))
                        # the other requests that this decode step ended hand over their last pieces before this
                        # one's release and its consumer's upkeep (the abort below, the final responses)
                        await asyncio.sleep(0)
                        return
                    output = _next_queued(outputs)
                if ids:
                    yield Piece("".join(deltas), ids, None, tuple(entries), cumulative, prompt)
                    prompt = None
                if output is CANCELLED:
                    yield Piece("", [], "abort", (), cumulative)
                    return
                if output is not None:  # a failure, after the tokens before it
                    if output.failure.kind == INVALID_INPUT:
                        raise InvalidInput(output.failure.message)
                    raise StageError(output.failure)
        finally:
            await engine.abort(req_id)


    def _stop_reason(self, detok: Detokenizer, last: Output) -> int | str | None:
        """vLLM v1's ``stop_reason`` of an output that ended with ``last``: the stop string matched, else the stop
        token's id unless it is the tokenizer's eos (vLLM's ``check_stop`` gives None for that one; the generation
        config's other eos ids are stop tokens to it)."""
        if detok.stopped:
            return detok.matched
        return last.token if last.finish_reason == "stop" and last.token != self.tokenizer.eos_token_id else None

    def _entry(self, token: int, logprobs: TokenLogprobs) -> dict[str, dict]:
        """The vLLM backend's ``logprobs`` entry of one token: the sampled token, then the top ones (ranks 1, 2, ...
        in order; the sampled token keeps its own rank where it is among them), each with its text alone and its
        log probability floored at :data:`MIN_LOGPROB`."""
        entry = {str(token): {"logprob": _floored(logprobs.logprob), "rank": logprobs.rank,
                              "decoded_token": self._text(token)}}
        for rank, (top, logprob) in enumerate(logprobs.top, start=1):
            entry.setdefault(str(top), {"logprob": _floored(logprob), "rank": rank, "decoded_token": self._text(top)})
        return entry

    def _prompt_json(self, prompt_ids: Sequence[int], figures: PromptLogprobs) -> str:
        """:attr:`Piece.prompt_logprobs`' JSON text: the first prompt token's entry (its text; its log probability
        and rank null), then each later prompt token's, as :meth:`_entry` makes them. Written as text, not built as
        objects: a 32,000-token prompt's top 20 make 700,000 dicts, which set off the collector's full passes
        (pausing every stream of the process tens of ms each). One entry a line (JSON allows the whitespace; a
        token's text has its line breaks escaped), so that a reader can parse it entry by entry
        (``client.pieces.json_entries``). Raises ValueError when ``figures`` are not one row per prompt token after
        the first."""
        if not prompt_ids:
            return "[]"
        values, top = memoryview(figures.figures).cast("f"), figures.top
        width = 2 + 2 * top
        if len(values) != width * (len(prompt_ids) - 1):
            raise ValueError(f"{len(values) // width} prompt log probabilities for {len(prompt_ids)} prompt tokens")
        parts = [f'{{"{prompt_ids[0]}": {{"logprob": null, "rank": null, '
                 f'"decoded_token": {self._json_text(prompt_ids[0])}}}}}']
        for at, token in zip(range(0, len(values), width), prompt_ids[1:]):
            fields = [self._json_field(token, values[at], int(values[at + 1]))]
            fields += [self._json_field(best, values[at + 2 + top + j], j + 1)
                       for j in range(top) if (best := int(values[at + 2 + j])) != token]
            parts.append("{" + ", ".join(fields) + "}")
        return "[\n" + ",\n".join(parts) + "\n]"  # an entry a line: readers parse it entry by entry (json_entries)

    def _json_field(self, token: int, logprob: float, rank: int) -> str:
        """One token's member of an entry, as ``json.dumps`` writes it."""
        return f'"{token}": {{"logprob": {_floored(logprob)!r}, "rank": {rank}, "decoded_token": ' \
               f'{self._json_text(token)}}}'

    def _json_text(self, token: int) -> str:
        """The token's text alone as a JSON string, made once per id."""
        text = self._quoted.get(token)
        if text is None:
            text = self._quoted[token] = json.dumps(self._text(token))
        return text

    def _text(self, token: int) -> str:
        """The token's text alone (``tokenizer.decode([token])``), decoded once per id."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text


def _floored(logprob: float) -> float:
    """``logprob``, or :data:`MIN_LOGPROB` where it is below it or not finite (NaN, infinities: JSON has none)."""
    return logprob if MIN_LOGPROB <= logprob < math.inf else MIN_LOGPROB


def _next_queued(outputs: asyncio.Queue) -> Output | None:
    """The next output already in ``outputs``, or None (nothing waits)."""
    try:
        return outputs.get_nowait()
    except asyncio.QueueEmpty:
        return None
