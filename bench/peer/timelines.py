"""Where UnifiedServe's time went in the peer benchmark (issue 20, item 1), from the timelines its requests bring
back (``return_timeline``; orchestrator/timeline.py).

``<out>/timelines.json``: per scenario, where each kind of request's time to first token went (:func:`ttft_parts`),
at which hop the gaps between tokens open (:func:`token_gaps`), where in the replies the largest gaps fall
(:func:`gap_places`), in the mixed scenarios the text streams' gaps by the phase of the encode_prefill step they
ended in (:func:`gap_phases`), and for those of ``SCENARIOS`` the server's encode_prefill steps rebuilt from the
timelines of all its requests (:func:`steps_of`);
``<out>/gantt_<scenario>.png``: the first request's Gantt chart (``bench/timeline_chart.py``); the raw records keep
every timeline. Each request's timeline names only its own share of a step (its groups and prompt tokens), so a step
is the set of shares with the same worker time, launched at about the same time (each request's clock starts at its
own arrival, a few ms apart).
"""
from __future__ import annotations

import statistics
from pathlib import Path

from bench.common import write
from bench.peer import client_loop
from bench.timeline_chart import gantt_chart, spans

SCENARIOS = ("video", "images16", "text_c32")
MIXED = ("mixed_video", "mixed_images")  # the scenarios whose text gaps :func:`gap_phases` places
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


# The parts of a request's time to first token, each between two moments of its timeline (ms since the orchestrator
# received it: the API process's moments are negative); "outside" is what the client saw beyond the API's own span.
TTFT_PARTS = {"api_to_orchestrator": ("api_sent", None), "admission": (None, "engine_added"),
              "to_first_step": ("engine_added", "first_step"), "steps": ("first_step", "first_token"),
              "first_token_to_api": ("first_token", "api_first_chunk")}
_MOMENTS = {m for pair in TTFT_PARTS.values() for m in pair if m} | {"api_received"}  # a record must have them all


def ttft_parts(records: list[dict]) -> dict[str, dict]:
    """Per request kind, the median and largest of each part of the time to first token (ms; :data:`TTFT_PARTS`:
    the API process to the orchestrator, admission (parse, media probe, prompt), waiting for the first step that
    holds the request (its media decoded, a step free), the steps up to its first token, the first token back to the
    API process) and ``outside``: the client's TTFT less the API's span from receiving the request to sending its
    first chunk (HTTP both ways and the client itself). Records without those moments are left out."""
    parts: dict[str, dict[str, list[float]]] = {}
    for r in records:
        events = (r.get("timeline") or {}).get("events", ())
        at = {e["event"]: e["ms"] for e in reversed(events)}  # the first of each name
        steps = [e["launched_ms"] for e in events if e["event"] == "step"]
        if steps:
            at["first_step"] = min(steps)
        if r.get("ttft_ms") is None or not _MOMENTS <= at.keys():
            continue
        kind = parts.setdefault(r["kind"], {name: [] for name in (*TTFT_PARTS, "outside")})
        for name, (start, end) in TTFT_PARTS.items():
            kind[name].append((at[end] if end else 0.0) - (at[start] if start else 0.0))
        kind["outside"].append(r["ttft_ms"] - (at["api_first_chunk"] - at["api_received"]))
    return {kind: {name: {"p50_ms": statistics.median(v), "max_ms": max(v)} for name, v in by_part.items()}
            for kind, by_part in parts.items()}


# A token's hops on its way out, in order (the timeline's ``tokens``, orchestrator/timeline.py, each hop's list named
# ``<hop>_us``): decode's launch of its step, decode's read of it, its arrival in the orchestrator, the send of its
# response to Triton, the API's chunk of it; then the client. A decode token's lists start at the second token (the
# first comes from prefill).
HOPS = ("decode_launched", "decode_read", "received", "sent", "api_chunk", "client")
DECODE_HOPS = HOPS[:3]
OPENED_SHARE = 0.6  # a large gap opened at the first hop where the gap between the two tokens is this share of it


def _hop_gaps(record: dict) -> list[dict]:
    """Per token from the third on (both it and the one before from decode), the gap before it at each hop (ms)
    where the record has that hop for both tokens, and with the record's ``sent_clock_s`` the two tokens' arrivals
    on ``time.perf_counter()``'s clock (``span_s``)."""
    tokens = (record.get("timeline") or {}).get("tokens") or {}
    client = [t * 1e3 for t in record.get("token_s") or ()]
    out = []
    clock = record.get("sent_clock_s")
    for i in range(2, len(client)):
        gaps = {"client": client[i] - client[i - 1]}
        if clock is not None:  # the gap on time.perf_counter()'s clock (bench.peer.client_loop)
            gaps["span_s"] = (clock + client[i - 1] / 1e3, clock + client[i] / 1e3)
        for hop in HOPS[:-1]:
            at = tokens.get(f"{hop}_us") or ()
            k = i - 1 if hop in DECODE_HOPS else i  # decode's lists start at the second token
            if k < len(at) and at[k] is not None and at[k - 1] is not None:
                gaps[hop] = (at[k] - at[k - 1]) / 1e3
        out.append(gaps)
    return out


def token_gaps(records: list[dict], stalls: list[list[float]] | None = None) -> dict | None:
    """Where the gaps between tokens open: per hop (:data:`HOPS`) the p50 and p99 of the gaps between successive
    tokens (ms), and for the client's gaps at or above its p99 (``large_from_ms``) how many opened at each hop: the
    first hop whose gap is at least ``OPENED_SHARE`` of the client's (a slow decode step shows at every hop from
    decode's launch on; a stalled send only from the send on). With the load generator's loop ``stalls``
    (``bench.peer.client_loop``; records with ``sent_clock_s``), ``client_loop_stalled``: of those opened at the
    client, how many had its loop busy within them (one stall) for at least ``OPENED_SHARE`` of their excess over the
    p50 gap (the client was busy); the others were late in the API's send or on the way. None when no record has
    per-token moments."""
    gaps = [g for r in records if (r.get("timeline") or {}).get("tokens") for g in _hop_gaps(r)]
    if not gaps:
        return None
    by_hop = {h: sorted(g[h] for g in gaps if h in g) for h in HOPS}
    large_from, p50 = _p99(by_hop["client"]), statistics.median(by_hop["client"])
    opened: dict[str, int] = {}
    stalled = 0
    for g in gaps:
        if g["client"] >= large_from:
            hop = next(h for h in HOPS if g.get(h, 0.0) >= OPENED_SHARE * g["client"])  # the client's own at last
            opened[hop] = opened.get(hop, 0) + 1
            stalled += hop == "client" and "span_s" in g and client_loop.overlaps(
                stalls or [], *g["span_s"], OPENED_SHARE * (g["client"] - p50))
    return {"gaps": len(gaps), "large_from_ms": large_from, "large_opened_at": opened,
            **({"client_loop_stalled": stalled} if stalls is not None else {}),
            **{h: {"p50_ms": statistics.median(v), "p99_ms": _p99(v)} for h, v in by_hop.items() if v}}


# Places in a reply (gap k: between its k-th and (k+1)-th token) that :func:`gap_places` tells apart: the burst's joins
# show in the first two gaps (the first token comes from prefill), the requests' ends in the last six
# (bench/results/peer/nineteenth-run-h100-2026-12-06/README.md).
LAST_GAPS = 6


def gap_places(records: list[dict]) -> dict | None:
    """Where in the replies the client's largest gaps fall: every gap between successive tokens of every request
    (those the summary's TBT p99 is taken over), its p99 (ms, nearest rank) and how many gaps at or above it are
    each request's first, its second, among its last :data:`LAST_GAPS`, or elsewhere. None when no request has
    two tokens."""
    places = []  # (gap ms, place)
    for r in records:
        arrivals = r.get("token_s") or ()
        n = len(arrivals) - 1
        for k in range(1, n + 1):
            place = "first" if k == 1 else "second" if k == 2 else "last_six" if k > n - LAST_GAPS else "other"
            places.append(((arrivals[k] - arrivals[k - 1]) * 1e3, place))
    if not places:
        return None
    p99 = _p99(sorted(gap for gap, _ in places))
    large = {place: 0 for place in ("first", "second", "last_six", "other")}
    for gap, place in places:
        large[place] += gap >= p99
    return {"gaps": len(places), "p99_ms": p99, "large_at": large}


def gap_phases(records: list[dict]) -> dict | None:
    """The text streams' gaps between decode steps by what encode_prefill was doing when the later step was read:
    its ``encode`` phase, its ``prefill`` phase (a step's span from its launch: ``encode_ms`` then the rest of its
    ``worker_ms``, :func:`steps_of`; a step without phase times counts as prefill), or ``no_step``. Each gap is
    decode's read of a text record's token minus its read of the token before (``decode_read_us``), placed on the
    scenario's clock as :func:`steps_of` places the steps (each record's clock starts at its own arrival: both are
    a few ms off, alike). Per phase: ``gaps``, ``p50_ms``, ``p99_ms``, ``max_ms`` and ``at_p99``: how many of the
    gaps at or above the p99 of all of them (ms, nearest rank: ``p99_ms`` at the top) fall there. None without a
    text record with decode's reads."""
    spans = [(s["launched_s"], s["launched_s"] + s.get("encode_ms", 0.0) / 1e3,
              s["launched_s"] + s["worker_ms"] / 1e3) for s in steps_of(records)]

    def phase(at_s: float) -> str:
        for start, encoded, end in spans:
            if start <= at_s < end:
                return "encode" if at_s < encoded else "prefill"
        return "no_step"

    found: dict[str, list[float]] = {}
    for r in records:
        if r["kind"] != "text":
            continue
        reads = ((r.get("timeline") or {}).get("tokens") or {}).get("decode_read_us") or ()
        for before, after in zip(reads, reads[1:]):
            if before is not None and after is not None:
                found.setdefault(phase(r["sent_s"] + after / 1e6), []).append((after - before) / 1e3)
    if not found:
        return None
    p99 = _p99(sorted(g for gaps in found.values() for g in gaps))
    out: dict = {"p99_ms": p99}
    for name, gaps in sorted(found.items()):
        gaps.sort()
        out[name] = {"gaps": len(gaps), "p50_ms": statistics.median(gaps), "p99_ms": _p99(gaps), "max_ms": gaps[-1],
                     "at_p99": sum(g >= p99 for g in gaps)}
    return out


def _p99(ordered: list[float]) -> float:
    """The 99th percentile of ``ordered`` (sorted, not empty) by nearest rank: a value of the list."""
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def write_timelines(out: Path, runs: dict[str, dict]) -> list[Path]:
    """Write ``timelines.json`` and the Gantt charts from UnifiedServe's raw scenarios ``runs`` ({scenario: raw
    JSON}); returns the files written (none when no request brought a timeline)."""
    found, written = {}, []
    for name, run in runs.items():
        records = [r for r in run.get("records", []) if r.get("timeline")]
        if not records:
            continue
        found[name] = {"ttft_parts": ttft_parts(records)}
        if (gaps := token_gaps(records, (run.get("client_loop") or {}).get("stalls"))) is not None:
            found[name]["token_gaps"] = gaps
        if (places := gap_places(records)) is not None:
            found[name]["gap_places"] = places
        if name in MIXED and (phases := gap_phases(records)) is not None:
            found[name]["gap_phases"] = phases
        if name not in SCENARIOS:
            continue
        found[name]["steps"] = steps_of(records)
        path = out / f"gantt_{name}.png"
        gantt_chart(f"unifiedserve, {name}: the first request's timeline (ms since it arrived)",
                    spans(records[0]["timeline"]["events"]), path)
        written.append(path)
    if found:
        written.append(write(out, "timelines", found))
    return written
