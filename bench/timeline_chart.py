"""A request's timeline (``return_timeline``, orchestrator/timeline.py) as a Gantt-style chart: where its time to
first token went (the serve bench draws one per media scenario).

Rows: ``admission`` (arrival to the engine: parse, probe, prompt), ``media`` (the engine to the last group decoded,
a tick per group), one bar per encode_prefill step with work of the request (launch to result; encode steps and
prefill-only steps in their own colours), and ``first token`` (arrival to it). Times in ms since arrival.
"""
from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

# row kind -> colour
COLOURS = {"admission": (120, 120, 120), "media": (60, 150, 80), "encode": (200, 90, 50), "prefill": (70, 110, 180),
           "first token": (150, 80, 160)}


def spans(events: list[dict]) -> list[tuple[str, str, float, float]]:
    """``(label, kind, start_ms, end_ms)`` bars of a timeline's events (its ``events`` list), in time order of
    their start; ticks (``group_ready``) are zero-length ``media`` spans. Events a request did not reach are left
    out."""
    at = {e["event"]: e["ms"] for e in events}  # the first of each name is enough for the markers used here
    out: list[tuple[str, str, float, float]] = []
    if "engine_added" in at:
        out.append(("admission", "admission", 0.0, at["engine_added"]))
        ready = [e["ms"] for e in events if e["event"] == "group_ready"]
        if ready:
            out.append(("media", "media", at["engine_added"], max(ready)))
            out += [("media", "media", t, t) for t in ready]
    for k, step in enumerate(e for e in events if e["event"] == "step"):
        kind = "encode" if step["encode_groups"] else "prefill"
        out.append((f"step {k}", kind, step["launched_ms"], step["ms"]))
    if "first_token" in at:
        out.append(("first token", "first token", 0.0, at["first_token"]))
    return sorted(out, key=lambda s: s[2])


def gantt_chart(title: str, bars: list[tuple[str, str, float, float]], path: Path, max_rows: int = 60) -> None:
    """Draw ``bars`` (from :func:`spans`) one row per label, in order of first appearance; more than ``max_rows``
    step rows are merged into one ``steps`` row (a 3-minute video has hundreds)."""
    labels = list(dict.fromkeys(label for label, *_ in bars))
    if len(labels) > max_rows:
        bars = [("steps" if label.startswith("step ") else label, kind, a, b) for label, kind, a, b in bars]
        labels = list(dict.fromkeys(label for label, *_ in bars))
    if not bars:
        return
    end = max(b for *_, b in bars) or 1.0
    left, width, row = 110, 900, 14
    image = Image.new("RGB", (left + width + 20, 60 + row * len(labels) + 30), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 10), title, fill="black")
    draw.text((left, 30), "0 ms", fill="black")
    draw.text((left + width - 60, 30), f"{end:.0f} ms", fill="black")
    x = lambda ms: left + ms / end * width  # noqa: E731
    for label, kind, a, b in bars:
        y = 50 + row * labels.index(label)
        draw.rectangle([x(a), y, max(x(b), x(a) + 1), y + row - 3], fill=COLOURS[kind])
    for k, label in enumerate(labels):
        draw.text((6, 50 + row * k), label, fill="black")
    for k, (kind, colour) in enumerate(COLOURS.items()):
        draw.text((left + 150 * k, 60 + row * len(labels) + 8), kind, fill=colour)
    image.save(path)
