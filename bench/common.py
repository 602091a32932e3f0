"""What every benchmark shares: the run's header (device, date, versions), CUDA-event timing, a bar chart and
an x-y chart (drawn with Pillow, so no plotting library is needed), writing ``<out>/<stem>.json`` + ``.png``, and the
``--preset`` option of the benchmarks that build a preset's model.

A benchmark writes into the folder its ``--out`` names. The project keeps each benchmark's latest run in a folder
``results/<benchmark>-<device>-<date>/`` beside these scripts (its README says what ran and what it shows), and
the figures that defaults and the README rely on in ``RESULTS.md``, one row each."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Callable

import torch
from PIL import Image, ImageDraw

from backends.runtime.presets import PRESETS

H200_HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy (bench/RESULTS.md, "HBM bandwidth")
H200_BF16_FLOPS = 790e12  # measured dense bf16 matrix throughput (bench/RESULTS.md, "bf16 matrix throughput")
DEFAULT_PRESET = "qwen2_5_vl_7b"  # the preset of every result in bench/RESULTS.md that names none


def add_preset_argument(parser: argparse.ArgumentParser) -> None:
    """``--preset``: a name of ``backends.runtime.presets.PRESETS`` (default :data:`DEFAULT_PRESET`); the benchmark
    builds it with dummy bfloat16 weights whatever the preset's own dtype (flashinfer has no float32 kernels)."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET,
                        help="model preset, dummy bf16 weights (default %(default)s)")


def header(device: torch.device, extra_modules: tuple[str, ...] = ()) -> dict:
    """Device name, host cores, ISO date, and the versions of Python, torch, transformers and ``extra_modules``."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for module in ("transformers", "numpy", *extra_modules):
        try:
            found[module] = __import__(module).__version__
        except Exception:  # not installed there: the JSON simply lacks it
            pass
    return {"device": name, "cores": len(os.sched_getaffinity(0)),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "versions": found}


def cuda_times_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> list[float]:
    """Milliseconds of each of ``repeats`` runs of ``fn()``, timed with CUDA events after ``warmup`` runs
    (each run ends with a device sync, so host-side work inside ``fn`` counts too)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def cuda_time_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median of :func:`cuda_times_ms` (milliseconds)."""
    return statistics.median(cuda_times_ms(fn, repeats, warmup))


def graph_ms(body: Callable[[], object], repeats: int = 50, warmup: int = 1) -> float:
    """Median CUDA-event time (ms) of replaying a CUDA graph that captures ``body()``, after ``warmup`` runs of
    it on a side stream (lazy initialisation and compilation stay out of the graph)."""
    from backends.runtime.language_model.graph_capture import capture_graph

    graph, _ = capture_graph(torch.device("cuda", torch.cuda.current_device()), None, body,
                             mode=contextlib.nullcontext, runs=warmup)
    return cuda_time_ms(graph.replay, repeats)


def bar_chart(title: str, rows: list[tuple[str, float, str]], path: Path) -> None:
    """Horizontal bars: ``(label, value, text shown after the bar)`` per row, scaled to the largest value."""
    if not rows:
        return
    scale = 560 / max(max(v for _, v, _ in rows), 1e-12)
    image = Image.new("RGB", (1100, 44 + 22 * len(rows)), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 12), title, fill="black")
    for k, (label, value, text) in enumerate(rows):
        y = 44 + 22 * k
        draw.text((10, y + 4), label, fill="black")
        draw.rectangle([400, y, 400 + max(1, value * scale), y + 16], fill=(70, 110, 180))
        draw.text((406 + value * scale, y + 4), text, fill="black")
    image.save(path)


COLOURS = ((70, 110, 180), (200, 90, 50), (60, 150, 80), (150, 80, 160))


def xy_chart(title: str, series: dict[str, list[tuple[float, float]]], path: Path, x_label: str, y_label: str,
             log_y: bool = False, lines: bool = False, marks_x: tuple[float, ...] = (),
             y_range: tuple[float, float] | None = None, marks_y: tuple[float, ...] = (),
             ticks_x: tuple[float, ...] = ()) -> None:
    """Points ``(x, y)`` of each series in its own colour (joined when ``lines``), a legend, the axes' ranges;
    ``log_y``: a log10 y axis (positive values only); ``marks_x`` / ``marks_y``: grey lines at those x / y values
    (labelled on the y axis); ``y_range``: the y axis' (low, high) instead of the data's (linear axes);
    ``ticks_x``: x values labelled under the axis besides its ends."""
    points = [(x, y) for values in series.values() for x, y in values if not log_y or y > 0]
    if not points:
        return
    fy = (lambda y: math.log10(y)) if log_y else (lambda y: y)  # noqa: E731
    x0, x1 = min(x for x, _ in points), max(x for x, _ in points)
    y0, y1 = y_range or (min(fy(y) for _, y in points), max(fy(y) for _, y in points))
    width, height, left, top = 1000, 520, 80, 60
    image = Image.new("RGB", (width + left + 20, height + top + 50), "white")
    draw = ImageDraw.Draw(image)
    px = lambda x: left + (x - x0) / ((x1 - x0) or 1) * width  # noqa: E731
    py = lambda y: top + height - (fy(y) - y0) / ((y1 - y0) or 1) * height  # noqa: E731
    draw.text((10, 12), title, fill="black")
    draw.rectangle([left, top, left + width, top + height], outline="black")
    for x in marks_x:
        draw.line([px(x), top, px(x), top + height], fill=(170, 170, 170))
    for y in marks_y:
        draw.line([left, py(y), left + width, py(y)], fill=(170, 170, 170))
        draw.text((4, py(y) - 6), f"{y:.3g}", fill=(120, 120, 120))
    for x in ticks_x:
        if x0 < x < x1:
            draw.text((px(x) - 10, top + height + 8), f"{x:.3g}", fill="black")
    low, high = (10 ** y0, 10 ** y1) if log_y else (y0, y1)
    draw.text((4, top + height - 6), f"{low:.3g}", fill="black")
    draw.text((4, top - 6), f"{high:.3g}", fill="black")
    draw.text((4, top + height // 2), y_label + (" (log)" if log_y else ""), fill="black")
    draw.text((left, top + height + 8), f"{x0:.3g}", fill="black")
    draw.text((left + width - 40, top + height + 8), f"{x1:.3g}", fill="black")
    draw.text((left + width // 2 - 40, top + height + 24), x_label, fill="black")
    for k, (label, values) in enumerate(series.items()):
        colour = COLOURS[k % len(COLOURS)]
        shown = sorted((px(x), py(y)) for x, y in values if not log_y or y > 0)
        if lines and len(shown) > 1:
            draw.line(shown, fill=colour, width=2)
        for x, y in shown:
            draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=colour)
        draw.text((left + 10 + 220 * k, top - 20), label, fill=colour)
    image.save(path)


def write(out: Path, stem: str, results: dict) -> Path:
    """Write ``<out>/<stem>.json`` (indented) and return its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(results, indent=1))
    return path
