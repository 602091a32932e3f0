"""SLO attainment and goodput (issue 19's goodput test), pure functions over request records.

A request meets its SLOs when it ended without error, its TTFT is within ``factor`` x the best (lowest) unloaded
TTFT of its request type measured in the same run, and the p99 of its own TBT gaps is at most 50 ms. Attainment at
a rate: the share of that rate's requests that meet both. Goodput: the highest rate measured whose attainment is at
least 90% (DistServe's definition, as the paper uses it). Records are ``RequestRecord.to_json()`` dicts.
"""
from __future__ import annotations

import numpy as np

TBT_P99_SLO_MS = 50.0
TTFT_FACTOR = 2.0
FACTORS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0)  # the attainment is also reported as the TTFT factor goes 1x..5x
ATTAINMENT_GOAL = 0.9


def best_unloaded_ttft(records: list[dict]) -> dict[str, float]:
    """The lowest TTFT (ms) per request ``kind`` among the error-free records of the unloaded pass."""
    best: dict[str, float] = {}
    for r in records:
        if r.get("error") is None and r.get("ttft_ms") is not None:
            best[r["kind"]] = min(best.get(r["kind"], float("inf")), r["ttft_ms"])
    return best


def tbt_p99_ms(record: dict) -> float | None:
    """The p99 of one request's TBT gaps (ms, numpy's linear percentile); None with fewer than two tokens."""
    times = record.get("token_s") or []
    if len(times) < 2:
        return None
    return float(np.percentile(np.diff(times) * 1e3, 99))


def meets_slo(record: dict, best_ttft_ms: dict[str, float], factor: float = TTFT_FACTOR,
              tbt_slo_ms: float = TBT_P99_SLO_MS) -> bool:
    """Whether one request met both SLOs. Raises KeyError when its kind has no unloaded TTFT."""
    if record.get("error") is not None or record.get("ttft_ms") is None:
        return False
    p99 = tbt_p99_ms(record)
    return record["ttft_ms"] <= factor * best_ttft_ms[record["kind"]] and (p99 is None or p99 <= tbt_slo_ms)


def attainment(records: list[dict], best_ttft_ms: dict[str, float], factor: float = TTFT_FACTOR,
               tbt_slo_ms: float = TBT_P99_SLO_MS) -> float | None:
    """The share (0..1) of ``records`` that met both SLOs; None for no records."""
    if not records:
        return None
    return sum(meets_slo(r, best_ttft_ms, factor, tbt_slo_ms) for r in records) / len(records)


def goodput(attainment_by_rate: dict[float, float | None], goal: float = ATTAINMENT_GOAL) -> float | None:
    """The highest rate (requests/s) whose attainment is at least ``goal``; None when no rate reaches it."""
    passing = [rate for rate, share in attainment_by_rate.items() if share is not None and share >= goal]
    return max(passing, default=None)


def attainment_table(runs: dict[float, list[dict]], best_ttft_ms: dict[str, float],
                     factors: tuple[float, ...] = FACTORS) -> dict[str, dict[str, float | None]]:
    """Attainment per TTFT factor (keys ``"2.0x"``) and per rate (keys the rate as text, requests/s)."""
    return {f"{factor}x": {str(rate): attainment(records, best_ttft_ms, factor)
                           for rate, records in sorted(runs.items())} for factor in factors}
