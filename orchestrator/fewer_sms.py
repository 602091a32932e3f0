"""Which encode/prefill steps run on fewer SMs: the ones beside decode that only bring a video closer to its first
token (``StepPlan.fewer_sms``; the stage runs them on its green context of ``sms_while_decoding`` SMs where one is
configured, ``backends.stages.step_streams``).

A step is marked when decode holds a stream whose TBT target (``slo_<modality>_tbt_ms`` divided by
``decode_priority_boost``) is tighter than :data:`~orchestrator.budget_policy.DEFAULT_TBT_MS`, and the step carries
a video's encode or prefill, no image's, and ends no video prompt. Why those: a video's TTFT is seconds away, so its
middle chunks can give up SMs, while an image's TTFT and the step that ends a video's prompt cannot (those are paced
instead, ``orchestrator.decode_pace``); and streams with the default 50-ms target (the video goodput workload's
answers) keep their TBT beside chunks on the whole GPU.

Measured on one H200 (bench/results/peer/settings-twelfth-2026-12-04/README.md, the whole-GPU figures in
bench/results/peer/README.md, the twelfth run): 16 text streams (15-ms target) beside the 3-minute video's chunks on
120 of 132 SMs while decoding, text TBT p99 14.3 ms in the window against 10.3 text-only (26.2 against 11.7 on the
whole GPU), the video's TTFT 17.7 s (12.8 s; vLLM 25.5 s in the same lease); every step planned while decoding went
on the green context then (the rule before this one, not yet measured), and 16 images beside the streams reached
their first token 18% later (1,351 against 1,146 ms), hence no image work here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from backends.ipc.protocol import StepPlan
from orchestrator.budget_policy import DEFAULT_TBT_MS, SloTargets


@dataclass(frozen=True)
class FewerSms:
    """The rule of the module docstring; ``targets``: the per-modality TBT targets; ``boost``:
    ``decode_priority_boost`` (>= 1)."""

    targets: SloTargets = SloTargets()
    boost: float = 1.0

    def __call__(self, plan: StepPlan, decoding: Sequence[str], kind_of: Callable[[str], str | None]) -> bool:
        """Whether ``plan`` runs on fewer SMs, ``decoding`` the modality of each request in the decode batch,
        ``kind_of(req_id)`` a request's modality (None: it has gone)."""
        if not decoding:
            return False
        if self.targets.tightest_tbt_ms(decoding, self.boost) >= DEFAULT_TBT_MS:
            return False
        kinds = {kind_of(work.req_id) for work in (*plan.encode, *plan.prefill)}
        if "video" not in kinds or "image" in kinds:
            return False
        return not any(work.is_last and kind_of(work.req_id) == "video" for work in plan.prefill)
