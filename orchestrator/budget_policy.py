"""SLO-driven token budgets: each step's encode and prefill budgets follow the decode batch's TBT headroom and the
waiting requests' TTFT deadlines (the design card's "dynamic quotas by SLO"). Pure Python, fed by measured times.

encode_prefill and decode share the GPU, so a longer encode/prefill step stretches the decode steps that overlap
it: the gap between decode steps (the TBT every stream sees) grows with the step budgets. The policy scales both
configured budgets by one factor ``scale`` in [``min_scale``, ``max_scale``]:

* nothing decoding: ``max_scale`` (no stream to protect; a lone video reaches its first token sooner, as larger
  budgets measured on the H200: bench/RESULTS.md), halved while the step, at the measured cost per unit of work,
  would end past the TTFT target of a waiting request that it would finish (down to 1: 16 text prompts that came
  while a video was prefilled waited out its 8x steps of 1.8-3.0 s, whose ends found nothing decoding:
  bench/results/peer/h100-run-2026-12-07/); once something decodes again, 1: the configured budgets, those tuned
  beside decode (the idle factor kept beside 16 text streams let 13 images' step run 727 ms, every stream stalled
  as long: the same run);
* the largest of the last ``window`` decode gaps over the TBT target (the tightest ``tbt_ms`` of the modalities
  decoding, divided by ``decode_priority_boost``): halved (multiplicative decrease, as TCP's congestion control
  backs off), and the halving judged by the gaps after it: where their largest is not at least 10% under the one
  that set it off (``SHRINK``), the gaps do not follow the budgets, so the halving is undone and the factor goes no
  lower until the gaps fall under half the target or nothing decodes. Beside decode paced at 80% of a 15-ms target
  (``orchestrator.decode_pace``) 16 images' steps stretched decode's steps to 20-35 ms at every factor tried: the
  policy without this rule fell to ``min_scale`` within four steps and made the images 1.6-2.2x later for no shorter
  gap (bench/results/peer/mixed-images-settings-h100-2026-12-07/). Steps run one after another, so the first gap
  after a judgement over the target spans the end of the step planned before it: it is not judged;
* under half the target after a step that used at least half its budgets (``FULL``: the gaps say how such a
  step weighs on decode; small steps say nothing of it), and a waiting request whose remaining work, at the
  measured cost per unit of work and the current scale, would pass its TTFT target: doubled; under half the target
  after such a step otherwise: x1.25; else kept. Each raise is judged by the gaps after it, as a halving is.

Budgets never fall below one patch and one token, and the scheduler's fairness rules are unchanged, so every
request still progresses. A unit of work is one prefill token or four encode patches (one visual token after the
2x2 merge).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from backends.triton.triton_io import MODALITIES, float_parameter

DEFAULT_TBT_MS = 50.0  # the per-request p99 TBT SLO of the peer benchmark (issue 19)
SHRINK = 0.9  # a halving is kept where the largest gap after it is under this share of the one before it
FULL = 0.5  # a step with this share of its budgets' work (or more) tells whether the budgets may grow


def work_units(tokens: int, patches: int) -> float:
    """The units of work of ``tokens`` prefill tokens and ``patches`` encode patches (module docstring)."""
    return tokens + patches / 4


@dataclass(frozen=True)
class SloTargets:
    """Per modality (a request with a video counts as video, one with images as image): ``ttft_ms`` and ``tbt_ms``
    targets (ms; a missing one: none for TTFT, :data:`DEFAULT_TBT_MS` for TBT)."""

    ttft_ms: dict[str, float] = field(default_factory=dict)
    tbt_ms: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "SloTargets":
        """From the orchestrator's ``slo_<modality>_ttft_ms`` / ``slo_<modality>_tbt_ms`` parameters (the deploy
        file's ``slo`` section). Raises ValueError naming a parameter that is not a positive number."""
        return cls(*({m: v for m in MODALITIES if (v := float_parameter(params, f"slo_{m}_{name}")) is not None}
                     for name in ("ttft_ms", "tbt_ms")))

    def tightest_tbt_ms(self, decoding: Iterable[str], boost: float = 1.0) -> float:
        """The tightest TBT target (ms) of the modalities ``decoding`` (not empty), divided by ``boost``
        (``decode_priority_boost``)."""
        return min(self.tbt_ms.get(kind, DEFAULT_TBT_MS) for kind in decoding) / boost


@dataclass(frozen=True)
class PolicyConfig:
    """``decode_priority_boost`` (>= 1): the TBT target is divided by it, so decode is protected sooner;
    ``min_scale`` / ``max_scale``: the range of the budgets' factor; ``window``: decode gaps judged (steps).
    Raises ValueError for values out of range."""

    decode_priority_boost: float = 1.0
    min_scale: float = 0.25
    max_scale: float = 8.0
    window: int = 16

    def __post_init__(self) -> None:
        if not self.decode_priority_boost >= 1:
            raise ValueError(f"decode_priority_boost must be >= 1, got {self.decode_priority_boost}")
        if not 0 < self.min_scale <= 1 <= self.max_scale:
            raise ValueError(f"need 0 < min_scale <= 1 <= max_scale, got {self.min_scale}, {self.max_scale}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")


@dataclass(frozen=True)
class Waiting:
    """A request before its first token: its ``kind`` (modality), ``age_ms`` since it arrived, and the work left
    (``units``: :func:`work_units`)."""

    kind: str
    age_ms: float
    units: float


class BudgetPolicy:
    """The budgets of the next step from ``encode_budget`` (patches) and ``prefill_budget`` (tokens), the
    configured ones, by the module docstring's rule."""

    def __init__(self, encode_budget: int, prefill_budget: int, targets: SloTargets,
                 config: PolicyConfig = PolicyConfig()):
        self.base = (encode_budget, prefill_budget)
        self.targets, self.config = targets, config
        self.scale = 1.0
        self._idle = False  # the last budgets were asked with nothing decoding
        self._floor = config.min_scale  # raised to a factor whose halving left the gaps as they were
        # the last halving: the factor before it, the gap that set it off
        self._halving: tuple[float, float] | None = None
        self._gaps: deque[float] = deque(maxlen=config.window)
        self._straddling = False  # the next gap began before the budgets changed: not judged
        self._full = False  # a step of at least FULL of the budgets' work ran since they last changed
        self._ms_per_unit: float | None = None  # measured, exponentially averaged

    def observe_decode_gap(self, ms: float) -> None:
        """The time between two decode steps that had sequences (ms): the TBT the streams see."""
        if self._straddling:  # it spans the end of the last step, planned with the budgets before
            self._straddling = False
            return
        self._gaps.append(ms)

    def observe_step(self, ms: float, units: float) -> None:
        """An encode/prefill step of ``units`` units of work took ``ms`` (launch to result)."""
        if units > 0:
            cost = ms / units
            self._ms_per_unit = cost if self._ms_per_unit is None else 0.8 * self._ms_per_unit + 0.2 * cost
        encode, prefill = self._budgets()
        self._full = self._full or units >= FULL * work_units(prefill, encode)

    def budgets(self, decoding: set[str], waiting: list[Waiting]) -> tuple[int, int]:
        """(encode patches, prefill tokens) for the next step; ``decoding``: the modalities of the sequences in the
        decode batch; ``waiting``: the requests not yet at their first token."""
        c = self.config
        if not decoding:
            self._floor, self._halving, self._straddling = c.min_scale, None, False
            self.scale = self._idle_scale(waiting)
            self._gaps.clear()  # gaps of another batch say nothing about the next one
        elif self._idle:
            self._changed(1.0)
        elif self._gaps:
            self._judge(self.targets.tightest_tbt_ms(decoding, c.decode_priority_boost), max(self._gaps), waiting)
        self._idle = not decoding
        return self._budgets()

    def _idle_scale(self, waiting: list[Waiting]) -> float:
        """The factor of a step with nothing decoding: ``max_scale`` halved while the step would end past the TTFT
        target of a waiting request whose remaining work it holds (the module docstring), at least 1."""
        scale, total = self.config.max_scale, sum(w.units for w in waiting)
        encode, prefill = self.base
        while scale > 1 and self._ms_per_unit is not None:
            units = min(total, scale * work_units(prefill, encode))
            if all(w.age_ms + units * self._ms_per_unit <= target for w in waiting
                   if w.units <= units and (target := self.targets.ttft_ms.get(w.kind)) is not None):
                break
            scale /= 2
        return max(1.0, scale)

    def _budgets(self) -> tuple[int, int]:
        return tuple(max(1, round(b * self.scale)) for b in self.base)

    def _changed(self, scale: float) -> None:
        """The factor is now ``scale``: judge it by its own gaps, from the first that begins after this step."""
        self.scale, self._full, self._straddling = scale, False, True
        self._gaps.clear()

    def _judge(self, target: float, worst: float, waiting: list[Waiting]) -> None:
        """The factor from ``worst``, the largest recent decode gap (ms), against ``target`` (ms): the module
        docstring's rule."""
        halving, self._halving = self._halving, None
        if worst > target:
            if halving is not None and worst >= SHRINK * halving[1]:  # the gaps did not follow the budgets
                self._floor = halving[0]
                self._changed(halving[0])
            elif self.scale > self._floor:
                self._halving = (self.scale, worst)
                self._changed(max(self._floor, self.scale / 2))
            else:
                self._changed(self.scale)
        elif worst < target / 2 and self._full:
            self._floor = self.config.min_scale
            self._changed(min(self.config.max_scale, self.scale * (2 if self._at_risk(waiting) else 1.25)))

    def _at_risk(self, waiting: list[Waiting]) -> bool:
        """A waiting request would pass its TTFT target: its age plus its work at the measured cost per unit, stretched
        by 1 / scale below scale 1 (fewer units per step, each step with its fixed costs). A heuristic: it ignores
        the other requests' work, so it errs towards raising the budgets."""
        if self._ms_per_unit is None:
            return False
        return any(w.age_ms + w.units * self._ms_per_unit / min(1.0, self.scale) > target for w in waiting
                   if (target := self.targets.ttft_ms.get(w.kind)) is not None)
