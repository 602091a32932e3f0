"""Where UnifiedServe's time went in the peer benchmark (issue 20, item 1), from the timelines its requests bring
back (``return_timeline``; orchestrator/timeline.py).

``<out>/timelines.json``: per scenario of ``SCENARIOS``, the server's encode_prefill steps rebuilt from the timelines
of all its requests (:func:`steps_of`); ``<out>/gantt_<scenario>.png``: the first request's Gantt chart
(``bench/timeline_chart.py``); the raw records keep every timeline. Each request's timeline names only its own
share of a step (its groups and prompt tokens), so a step is the set of shares with the same worker time, launched
at about the same time (each request's clock starts at its own arrival, a few ms apart).
"""
from __future__ import annotations

from pathlib import Path

from bench.common import write
from bench.timeline_chart import gantt_chart, spans

SCENARIOS = ("video", "images16", "text_c32")
SAME_STEP_S = 0.05  # shares of one step: the same worker time, launch times apart by the requests' clock offsets


def steps_of(records: list[dict]) -> list[dict]:
    """The encode_prefill steps that served ``records`` (raw records with ``timeline``), in launch order:
    ``launched_s`` from the scenario's start, ``worker_ms`` (the stage's own time for the step, its device work
    included), the device's ``encode_ms`` and ``prefill_ms`` where the server measured them, ``encode_patches``
    and ``prefill_tokens`` summed over the requests in it, ``requests``; and ``decoding``: how many of the records
    had their first token before the step was launched (their decode steps share the GPU with it)."""
    steps: list[dict] = []
    firsts = [r["sent_s"] + r["ttft_ms"] / 1e3 for r in records if r.get("ttft_ms") is not None]
    for r in records:
        for event in (r.get("timeline") or {}).get("events", ()):
            if event["event"] != "step":
                continue
            launched = r["sent_s"] + event["launched_ms"] / 1e3
            step = next((s for s in steps if s["worker_ms"] == event["worker_ms"]
                         and abs(s["launched_s"] - launched) < SAME_STEP_S), None)
            if step is None:
                step = {"launched_s": launched, "worker_ms": event["worker_ms"], "encode_patches": 0,
                        "prefill_tokens": 0, "requests": 0,
                        **{k: event[k] for k in ("encode_ms", "prefill_ms") if k in event}}
                steps.append(step)
            step["encode_patches"] += event["encode_patches"]
            step["prefill_tokens"] += event["prefill_tokens"]
            step["requests"] += 1
    out = sorted(steps, key=lambda s: s["launched_s"])
    for step in out:
        step["decoding"] = sum(first < step["launched_s"] for first in firsts)
    return out


def write_timelines(out: Path, runs: dict[str, dict]) -> list[Path]:
    """Write ``timelines.json`` and the Gantt charts from UnifiedServe's raw scenarios ``runs`` ({scenario: raw
    JSON}); returns the files written (none when no request brought a timeline)."""
    found, written = {}, []
    for name in SCENARIOS:
        records = [r for r in runs.get(name, {}).get("records", []) if r.get("timeline")]
        if not records:
            continue
        found[name] = {"steps": steps_of(records)}
        path = out / f"gantt_{name}.png"
        gantt_chart(f"unifiedserve, {name}: the first request's timeline (ms since it arrived)",
                    spans(records[0]["timeline"]["events"]), path)
        written.append(path)
    if found:
        written.append(write(out, "timelines", found))
    return written
