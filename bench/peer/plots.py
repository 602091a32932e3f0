"""The peer benchmark's plots (issue 19): text TBT over time in the mixed scenarios, goodput attainment vs rate.

``<out>/tbt_<scenario>_<system>.png``: every text TBT gap (ms, log scale) at the time its closing token arrived
(s from the scenario's start), grey lines where the burst was sent and where its last first token came.
``<out>/attainment_<workload>.png``: per system, the share of requests meeting both SLOs (TTFT within 2x the best
unloaded TTFT of their type, p99 TBT at most 50 ms) at each rate measured (requests/s; sessions/s for multiturn),
on a 0-1 axis with the 90% goal marked.
"""
from __future__ import annotations

from pathlib import Path

from bench.common import xy_chart
from bench.peer import figures, slo
from bench.peer.scenarios import WORKLOADS

MIXED = {"mixed_video": "video", "mixed_images": "image"}


def write_plots(out: Path, raw: dict[str, dict[str, dict]], reports: dict[str, dict]) -> list[Path]:
    """Draw what ``raw`` ({system: {scenario: raw JSON}}) and ``reports`` (summary.py's per system) allow; returns
    the files written."""
    written = []
    for system, runs in raw.items():
        for name, burst in MIXED.items():
            records = runs.get(name, {}).get("records", [])
            window = figures.burst_window(records, burst)
            if window is None:
                continue
            path = out / f"tbt_{name}_{system}.png"
            xy_chart(f"{system}, {name}: text TBT (ms) over time; grey: {burst} sent, its last first token",
                     {"text TBT": figures.timed_gaps([r for r in records if r["kind"] == "text"])}, path,
                     "s from the scenario's start", "TBT ms", log_y=True, marks_x=window)
            written.append(path)
    key = f"{slo.TTFT_FACTOR}x"
    for workload in WORKLOADS:
        series = {system: [(float(rate), share) for rate, share in
                           report["goodput"][workload].get("attainment", {}).get(key, {}).items() if share is not None]
                  for system, report in reports.items()}
        if any(series.values()):
            path = out / f"attainment_{workload}.png"
            unit = "sessions/s" if workload == "multiturn" else "requests/s"
            xy_chart(f"goodput {workload}: SLO attainment vs rate (TTFT {key} the best unloaded, p99 TBT "
                     f"{slo.TBT_P99_SLO_MS:.0f} ms; grey: the {slo.ATTAINMENT_GOAL:.0%} goal)", series, path, unit,
                     "attainment", lines=True, y_range=(0.0, 1.0), marks_y=(slo.ATTAINMENT_GOAL,),
                     ticks_x=tuple(sorted({x for values in series.values() for x, _ in values})))
            written.append(path)
    return written
