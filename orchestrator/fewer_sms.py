"""Which encode/prefill steps run on fewer SMs: by default a video's steps beside decode (``StepPlan.fewer_sms``; the
stage runs them on its green context of ``sms_while_decoding`` SMs where one is configured,
``backends.stages.step_streams``).

A step is marked when decode holds a stream whose TBT target (``slo_<modality>_tbt_ms`` divided by
``decode_priority_boost``) is tighter than :data:`~orchestrator.budget_policy.DEFAULT_TBT_MS`, and the step carries
encode or prefill work of a modality of ``fewer_sms_kinds`` (the orchestrator's parameter: ``video``, the default, or
``video,image``) and no media work of another; with ``text`` among them (``video,text``, ``video,image,text``) also a
step with no media work that ends no more prompts than there are requests decoding (:func:`favours_decode`: the step
the decode pacer leaves unpaced, ``orchestrator.decode_pace``). Why a video's by default: its TTFT is seconds away,
so its chunks can give up SMs, its last one too, while an image's TTFT cannot (its steps are paced instead,
``orchestrator.decode_pace``); and streams with the default 50-ms target (the video goodput workload's answers) keep
their TBT beside chunks on the whole GPU. ``video,image`` is for models whose decode step is long beside an image's
(a 38B language model's: each decode step reads its 61 GiB of weights while the images' steps run). ``text`` is for a
burst of text prompts: 32 at once reach decode over three steps, and the last (14 prompts beside the 18 streams the
one before ended, on the H100 of bench/results/peer/h100-run-2026-12-06/) slowed decode's steps from 6.7 to 10-12 ms
for 87 ms, the second token of those 18 streams with them: of the run's 274 gaps over 10 ms, 133 came in its first
0.3 s, during that step and the one before, where the target is a TBT p99 under 10 (issue 20); those prompts' TTFT
lies past the p50 whichever way. On an H100 (bench/results/peer/settings-h100-2026-12-06/) the text kind alone gave a
TBT p99 of 13.1-13.9 ms for those 32 prompts, within the spread between starts: off by default.

Measured on one H200, 16 text streams (15-ms TBT target) beside the 3-minute video, 120 of 132 SMs
(bench/results/peer/settings-thirteenth-2026-12-04/README.md and the runs it names):

* every step planned while decoding on the green context (the first rule): text TBT p99 in the window 14.3 ms against
  10.3 text-only (26.2 against 11.7 on the whole GPU), the video's TTFT 17.7 s (12.8 s; vLLM 25.5 s), but 16 images
  beside the streams reached their first token 18% later (1,351 against 1,146 ms): hence no image work here;
* a video's steps but its last (the second): 13.3 against 7.83 (1.69x), the video 16.8 s (vLLM 20.2 s); its last
  step ran on the whole GPU in 255 ms with decode paced 12 ms apart, and gave 166 of the window's 631 gaps over 1.5x
  the text-only p99;
* a video's steps, its last included (this rule): 11.6 against 7.57 (1.53x), max 25.8, the video 16.6 s (its last
  step 421 ms), the images' TTFT max 1,060 ms beside the streams.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from backends.ipc.protocol import StepPlan
from backends.triton.triton_io import choice_value
from orchestrator.budget_policy import DEFAULT_TBT_MS, SloTargets

DEFAULT_KINDS = frozenset({"video"})
MEDIA_KINDS = ("image", "video")
TEXT = "text"


def kinds_parameter(params: dict[str, str]) -> frozenset[str]:
    """The ``fewer_sms_kinds`` parameter (``video``, ``image``, ``video,image``, ``video,text`` or
    ``video,image,text``: ``triton_io.CHOICES``; empty or absent: :data:`DEFAULT_KINDS`) as a set. Raises ValueError
    naming the parameter for another value."""
    value = params.get("fewer_sms_kinds", "").strip()
    return frozenset(choice_value("fewer_sms_kinds", value).split(",")) if value else DEFAULT_KINDS


@dataclass(frozen=True)
class FewerSms:
    """The rule of the module docstring; ``targets``: the per-modality TBT targets; ``boost``:
    ``decode_priority_boost`` (>= 1); ``kinds``: the modalities whose steps may run on fewer SMs."""

    targets: SloTargets = SloTargets()
    boost: float = 1.0
    kinds: frozenset[str] = DEFAULT_KINDS

    def __call__(self, plan: StepPlan, decoding: Sequence[str], kind_of: Callable[[str], str | None]) -> bool:
        """Whether ``plan`` runs on fewer SMs, ``decoding`` the modality of each request in the decode batch,
        ``kind_of(req_id)`` a request's modality (None: it has gone)."""
        if not decoding:
            return False
        if self.targets.tightest_tbt_ms(decoding, self.boost) >= DEFAULT_TBT_MS:
            return False
        media = {kind_of(work.req_id) for work in (*plan.encode, *plan.prefill)}.intersection(MEDIA_KINDS)
        if media:
            return media <= self.kinds
        return TEXT in self.kinds and bool(plan.prefill) and favours_decode(ending_kinds(plan, kind_of), decoding)


def ending_kinds(plan: StepPlan, kind_of: Callable[[str], str | None]) -> list[str]:
    """The modality of each prompt ``plan`` ends (its last prefill chunk), ``kind_of(req_id)`` a request's (None:
    it has gone, and is left out)."""
    return [kind for work in plan.prefill if work.is_last and (kind := kind_of(work.req_id)) is not None]


def favours_decode(ending: Sequence[str], decoding: Sequence[str]) -> bool:
    """Whether a step that ends prompts of these modalities (``ending_kinds``) ends no more of them (a video's not
    counted) than there are requests ``decoding``: the waiting prompts do not outnumber the streams whose gaps a
    step beside them grows (``orchestrator.decode_pace`` paces decode for the other steps)."""
    return sum(kind != "video" for kind in ending) <= len(decoding)
