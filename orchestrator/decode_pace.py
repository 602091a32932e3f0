"""Decode yields to a prefill that ends image prompts, or more prompts than decode holds (decode pacing): while an
encode/prefill step runs that prefills at least half the prefill budget and ends at least one image prompt, or more
prompts than there are requests decoding (a video's prompt not counted), the decode loop launches its steps at least
``decode_pace_ms`` apart instead of back to back, and at most ``TARGET_SHARE`` of the tightest TBT target of the
modalities decoding (``slo_<modality>_tbt_ms``, default 50 ms, divided by ``decode_priority_boost``) apart, so every
stream still gets its tokens within its target, jitter included (and the SLO policy, which halves the budgets when a
gap passes the target, is not set off by the pacing).

Why: the two stages share the GPU, and under MPS decode's steps run beside encode_prefill's at a higher priority. On
the H200 a 2,048-token prefill step took 88-95 ms with one sequence decoding beside it, where a chunk alone runs in
about 54 ms (bench/results/peer/fifth-run-2026-12-03/README.md, "Where the time goes"): each waiting prompt's first
token paid for decode steps that had TBT to spare. vLLM puts the decode tokens into its prefill batch, so its
streams wait the whole step. Pacing keeps the wait within the streams' TBT target.

Where decode is left alone (decode isolation, docs/design.md): a video's chunks, its last one included: its TTFT is
seconds away, and on the H200 the 3-minute video's last step, paced 12 ms apart on the whole GPU, was 255 ms of a
16.8-s TTFT and gave a quarter of the text streams' gaps over 1.5x their text-only TBT p99 (with
``sms_while_decoding`` set, those steps run on fewer SMs beside streams with a TBT target under 50 ms,
``orchestrator.fewer_sms``, which gives the figures; without it they share the whole GPU with decode, unpaced); a
short step is over in a decode step or two; and
a step that ends text prompts only, no more of them than the requests decoding: 32 text questions at once on the
H200 (bench/results/peer/sixth-run-2026-12-03/README.md) ended the last 11 in a 1,287-token step paced at 16 ms, and
the 21 streams decoding beside it got 72 of the run's 81 largest gaps (its top 1%, 14-26 ms; the TBT p99 13.8 ms),
while those 11 prompts' TTFT lay beyond the p50 either way; without pacing such steps the seventh run's p99 was
11.0 ms (bench/results/peer/seventh-run-2026-12-03/README.md).
The same burst's step before it, 17 prompts beside the first one's decode (97 ms against about 60 alone; the ninth
run, bench/results/peer/ninth-run-2026-12-03/README.md), is paced: the waiting prompts outnumber the streams whose
gaps grow, and a lone stream's few paced gaps are far from the TBT p99 of all of them.

Joining decode (``serial_joins``): decode's loop launches its next step before it reads the one in flight, so a
sequence admitted while a step runs waits for that step and for the one already queued behind it: its second token
came 2-3 decode steps after its first (on the H100, 32 text prompts at once: 13 ms p50 where a step took 6.7; vLLM's
second token comes one step after its first). While a step that ends prompts (a video's not counted) runs beside
decode, ``joins_decode`` says so and the orchestrator tells decode to run its steps one at a time (a pacing of
interval 0, or the step's pacing) until those prompts' sequences are admitted, so they join the next launch.

Holding a burst's joins (``hold_joins``): a burst of text questions reaches the orchestrator over 20-40 ms, so it
is prefilled in two or three steps, and the later steps ran beside the decode steps of the streams the earlier ones
had just started: on the H100, 32 text requests at once, each of those 17-24 streams had its first two or three
gaps at 11-31 ms (decode steps beside a 40-60 ms prefill step), 53-66 of the run's 82 gaps over its TBT p99
(bench/results/peer/twentieth-run-h100-2026-12-06/README.md). While a step whose prefill is text prompts alone, one
of them ending, runs, and most of the requests decoding have had no token from decode yet (the burst's own), decode
is held for the step (a pacing of interval :data:`PACE_FOR_MS`, ended once the step's sequences are admitted): its
streams wait the step out in one or two gaps instead of spreading it over three, the step runs alone, and the
burst's sequences all join decode's next launch. vLLM's streams wait in the same place: its decode tokens go into
the prefill step's batch. A stream that decode has already served is never the majority this rule needs, so
established streams (the mixed scenarios' text streams) are not held, and a hold needs :data:`HOLD_MIN_JOINING`
such streams: the mixed video's closed-loop text streams, down to three decoding near its end, met the majority rule
with one or three new ones, and one of them, held for two steps in a row, waited 130 ms for its second token (the
window max 31 ms without the hold; bench/results/peer/hold-joins-h100-2026-12-06/). From 2026-12-06 to 12-07 the
prompts the step ended counted toward the eight too (a burst's second step, 17 prompts beside its first request's
decode, was held: its prefill 45.5-53.9 ms against 51.3-54.4 paced, the client's TTFT p50 and TBT p99 within the
spread between passes; bench/results/peer/twenty-second-run-h100-2026-12-06/). It held the mixed video's text
streams when their closed loop restarted them together and the orchestrator split them over two steps (4-6, then
9-10 prompts): the first ones waited out the second step, 55-58 ms, and the window's max gap was 54.6-69.7 ms in all
three passes against 23-43 before (bench/results/peer/twenty-fourth-run-h100-2026-12-07/README.md). The step held
must itself end :data:`HOLD_MIN_ENDING` prompts (a burst's later part, not a trickle): the mixed video's streams,
restarted 11 in one step and 3 in the next, were held for the second (49 ms on an H100) and the 11 got their second
token 60-64 ms after their first, the window's max in both passes (44.8, 63.6 ms; target 50), where the 3 prompts'
gain was one step's wait (bench/results/peer/h100-run2-2026-12-07/README.md).
On by default: on one H100 host
the 32 requests' TBT p99 was 8.15-11.81 ms over seven passes (median 8.91) against 8.82-13.36 (median 11.72) over
eight with it off, vLLM 7.40-7.96 (the same README); the price is the burst's one longer gap (text_c32's largest,
52-93 ms against 23-36). The requests' ends, which the hold makes coincide, then hold most of the top 1%.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from backends.ipc.protocol import StepPlan
from orchestrator.budget_policy import SloTargets
from orchestrator.fewer_sms import ending_kinds, favours_decode

PACE_FOR_MS = 1000.0  # a pacing the orchestrator does not end (a step longer than this) ends itself
HOLD_MIN_JOINING = 8  # streams with no decode token yet that make a burst worth holding decode for
HOLD_MIN_ENDING = 8  # prompts the held step must end: the burst's later part
TARGET_SHARE = 0.8  # the most of a TBT target a paced gap may take
PACING_KINDS = frozenset({"image"})  # the modalities whose prompts ending in a step pace decode


@dataclass(frozen=True)
class DecodePacer:
    """``pace_ms`` (ms, > 0): the spacing of decode's launches during a qualifying step (module docstring);
    ``prefill_budget`` (tokens): the configured one; ``targets``: the per-modality TBT targets; ``boost``:
    ``decode_priority_boost`` (>= 1)."""

    pace_ms: float
    prefill_budget: int
    targets: SloTargets = SloTargets()
    boost: float = 1.0

    def interval_ms(self, plan: StepPlan, decoding: Sequence[str], kind_of: Callable[[str], str | None]) -> float:
        """The spacing of decode's launches while ``plan`` runs (ms; 0: none), ``decoding`` the modality of each
        request in the decode batch, ``kind_of(req_id)`` a request's modality (None: it has gone)."""
        if not decoding or 2 * plan.num_prefill_tokens < self.prefill_budget:
            return 0.0
        ending = ending_kinds(plan, kind_of)
        if not PACING_KINDS.intersection(ending) and favours_decode(ending, decoding):
            return 0.0  # a video's prompt ending does not count: its steps are never paced
        return min(self.pace_ms, TARGET_SHARE * self.targets.tightest_tbt_ms(decoding, self.boost))


def holds_joins(plan: StepPlan, decoding: Sequence[str], joining: int, kind_of: Callable[[str], str | None]) -> bool:
    """Whether decode waits ``plan`` out (module docstring, "Holding a burst's joins"): it encodes nothing, prefills
    text prompts only (a video's chunk beside them would hold the streams for its whole step) and ends at least
    :data:`HOLD_MIN_ENDING` of them, and ``joining`` (of the requests ``decoding``, their modalities, those with no
    token from decode yet) are more than half of them and at least :data:`HOLD_MIN_JOINING`."""
    if plan.num_encode_patches or 2 * joining <= len(decoding) or joining < HOLD_MIN_JOINING:
        return False
    return (len(ending_kinds(plan, kind_of)) >= HOLD_MIN_ENDING
            and all(kind_of(work.req_id) == "text" for work in plan.prefill))


def joins_decode(plan: StepPlan, decoding: Sequence[str], kind_of: Callable[[str], str | None]) -> bool:
    """Whether ``plan`` ends a prompt other than a video's while requests are ``decoding`` (their modalities): its
    sequence joins a decode loop that holds streams (module docstring, "Joining decode")."""
    return bool(decoding) and any(kind != "video" for kind in ending_kinds(plan, kind_of))


@dataclass(frozen=True)
class Joins:
    """How decode meets the sequences a step hands it: ``serial`` (``serial_joins``, "Joining decode") and ``hold``
    (``hold_joins``, "Holding a burst's joins")."""

    serial: bool = False
    hold: bool = True

    def pacing(self, pacer: DecodePacer | None, plan: StepPlan, decoding: Sequence[str], joining: int,
               kind_of: Callable[[str], str | None]) -> tuple[float, bool]:
        """(the interval in ms, 0: none; whether decode is told a pacing) while ``plan`` runs: a hold's, else
        ``pacer``'s (None: none), told also for ``serial`` joins; ``decoding``/``joining``/``kind_of`` as for
        :func:`holds_joins`."""
        if self.hold and holds_joins(plan, decoding, joining, kind_of):
            return PACE_FOR_MS, True
        paced = pacer.interval_ms(plan, decoding, kind_of) if pacer else 0.0
        return paced, bool(paced) or (self.serial and joins_decode(plan, decoding, kind_of))
