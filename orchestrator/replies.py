"""A client's responses described in plain Python on the event loop, built into Triton responses on a send lane
(``orchestrator.send_lanes``), where a lane that fell behind merges a request's queued replies into one.

A merged reply is what one response for those tokens would have been: texts joined, token ids concatenated, the
later reply's finish reason and flags. The vLLM backend's ``return_*`` outputs keep their meaning
(``orchestrator.frontend``): ``num_output_tokens`` counts that response's tokens (after a merge, the merged
response's), ``finish_reason`` is ``"None"`` until the last; ``visual_cap`` and ``media`` go on the first response
only and ``timeline`` on the last (streamed on a token channel: an entry of its own after the last tokens', sent
after them so that they do not wait for its JSON: :attr:`Reply.trailing`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import numpy as np

from backends.triton import triton_io as io
from orchestrator.inputs import ParsedRequest
from orchestrator.timeline import NO_TIMELINE, Timeline

log = logging.getLogger(__name__)

_NUMBER_OUTPUTS = {"output_ids": np.int64, "num_input_tokens": np.uint32, "num_output_tokens": np.uint32,
                   "num_cached_tokens": np.uint32, "cumulative_logprob": np.float32, "input_ids": np.int64}


def first_outputs(**values) -> tuple[tuple[str, str], ...]:
    """The STRING outputs of a request's first response only (``Reply.first_outputs``): each of ``values`` (output
    name -> its JSON-able value: ``visual_cap``, what max_visual_tokens changed in the request's media; ``media``,
    what was done with each item, ``orchestrator.media.media_report``; ``prompt_text``, a ``prompt_token_ids``
    request's prompt as text) that is not None, as JSON text."""
    return tuple((name, json.dumps(value)) for name, value in values.items() if value is not None)


@dataclass(frozen=True)
class Reply:
    """One response with tokens: ``text`` (the delta when streaming), ``ids`` the token ids it brings, ``reason``
    the finish reason (None: more follow), ``num_output`` the tokens of the whole output so far, ``flags`` the
    Triton send flags (final with a reason), ``first_outputs`` the (output name, JSON text) pairs of the request's
    first response only (:func:`first_outputs`; and ``input_ids``, a list, with ``return_input_ids``); the last
    carries the request's ``timeline`` when it asked for it.
    ``logprobs``: per token of ``ids``, its entry of the ``logprobs`` output (``orchestrator.output_processor``),
    where the request asked for them (``return_logprobs``); ``cumulative_logprob``: the sum of the whole output's
    token log probabilities so far (``return_cumulative_logprob``); ``stop_reason``: on the last, the stop string or
    token id that ended the output (``output_processor.Piece``), sent as JSON on every request's last response."""

    parsed: ParsedRequest
    text: str
    ids: list[int]
    reason: str | None
    num_input: int
    num_output: int
    flags: int = 0
    first_outputs: tuple[tuple[str, str | list[int]], ...] = ()
    timeline: Timeline = NO_TIMELINE
    num_cached: int = 0
    logprobs: tuple[dict, ...] = ()
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None

    @property
    def trailing(self) -> bool:
        """The last reply of a streamed request on a token channel that asked for its timeline, after its last
        tokens' reply (``orchestrator.frontend``): no tokens, the finish reason and the timeline. A send lane sends
        it after the other replies it has queued (``send_lanes.merged``), so that their tokens do not wait for its
        JSON."""
        return self.reason is not None and self.parsed.stream and not self.ids and self.parsed.extra_outputs.timeline

    def merge(self, later) -> Reply | None:
        """This reply followed by ``later`` (the same request's next) as one, or None: ``later`` is no Reply, or
        this one is the last."""
        if not isinstance(later, Reply) or self.reason is not None:
            return None
        return Reply(self.parsed, self.text + later.text, self.ids + later.ids, later.reason, self.num_input,
                     later.num_output, later.flags, self.first_outputs, later.timeline, later.num_cached,
                     self.logprobs + later.logprobs, later.cumulative_logprob, later.stop_reason)

    def build(self):
        """The ``InferenceResponse``; an INTERNAL error response if building it failed (a bug must not leave the
        client without its final flag)."""
        try:
            return io.pb().InferenceResponse(self._outputs())
        except Exception as exc:
            log.exception("orchestrator: a response could not be built")
            return io.error(f"internal error: {type(exc).__name__}: {exc}", invalid_argument=False)

    def sent(self) -> None:
        """Its tokens handed to Triton: noted on the request's timeline (``Timeline.sent``)."""
        self.timeline.sent(len(self.ids))

    def fields(self) -> dict[str, str | int | float | list[int]]:
        """The response's outputs, by name, as Python values (``output_ids`` a list, the JSON outputs as their
        text), in the order they are sent; the request's timeline is marked ``final_response`` when the last one's
        are taken."""
        extra, last = self.parsed.extra_outputs, self.reason is not None
        out: dict[str, str | int | float | list[int]] = {"text_output": self.text, **dict(self.first_outputs)}
        if last and extra.timeline:
            self.timeline.mark("final_response")
            out["timeline"] = self.timeline.to_json()
        if self.parsed.return_output_ids:
            out["output_ids"] = self.ids
        if extra.finish_reason or last:  # "None" until the last: the vLLM backend's str()
            out["finish_reason"] = str(self.reason)
        if extra.num_input_tokens or last:  # the prompt's counts: its tokens, those found in the prefix cache
            out["num_input_tokens"] = self.num_input
            out["num_cached_tokens"] = self.num_cached
        if extra.num_output_tokens or last:
            out["num_output_tokens"] = len(self.ids) if extra.num_output_tokens else self.num_output
        if last:
            out["stop_reason"] = json.dumps(self.stop_reason)
        if extra.logprobs:
            out["logprobs"] = json.dumps(self.logprobs)
        if extra.cumulative_logprob:
            out["cumulative_logprob"] = self.cumulative_logprob
        return out

    def _outputs(self) -> list:
        return [io.number_tensor(name, value if isinstance(value, list) else [value], _NUMBER_OUTPUTS[name])
                if name in _NUMBER_OUTPUTS else io.str_tensor(name, [value]) for name, value in self.fields().items()]


@dataclass(frozen=True)
class Built:
    """A response built already (an error), or none (``response`` None: the empty final response after an
    abort): sent as it is, never merged."""

    response: object = None
    flags: int = 0
    trailing = False

    def merge(self, later) -> None:
        return None

    def build(self):
        return self.response

    def sent(self) -> None:
        pass
