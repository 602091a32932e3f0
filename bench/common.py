"""What every benchmark shares: the run's header (device, date, versions), CUDA-event timing, a bar chart
(drawn with Pillow, so no plotting library is needed), and writing ``<out>/<stem>.json`` + ``.png``.

A benchmark writes into the folder its ``--out`` names. The project keeps each benchmark's latest run in a folder
``results/<benchmark>-<device>-<date>/`` beside these scripts (its README says what ran and what it shows), and
the figures that defaults and the README rely on in ``RESULTS.md``, one row each."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Callable

import torch
from PIL import Image, ImageDraw

H200_HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy (bench/RESULTS.md, "HBM bandwidth")
H200_BF16_FLOPS = 790e12  # measured dense bf16 matrix throughput (bench/RESULTS.md, "bf16 matrix throughput")


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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
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


def write(out: Path, stem: str, results: dict) -> Path:
    """Write ``<out>/<stem>.json`` (indented) and return its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(results, indent=1))
    return path
