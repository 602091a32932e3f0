"""Write a perf_analyzer ``--input-data`` JSON file for the ``orchestrator`` model.

    python -m client.perf_analyzer.make_inputs --video clip.mp4 [clip2.mp4 ...] [--video clip3.mp4 ...] \\
        [--image a.jpg ...] [--text "Describe the video."] [--max-tokens 128] [--ignore-eos] \\
        [--fps 2] [--max-pixels 200704] [--no-stream] -o inputs.json
    python -m client.perf_analyzer.make_inputs --video-url /data/clip.mp4 ... -o inputs.json

One ``data`` entry per video (perf_analyzer sends the entries round-robin); images, when given, go
with every entry (or make the one entry when there is no video). Format (perf_analyzer's
docs/input_data.md): a [1]-shaped STRING input is a list ``["..."]``; a BYTES input of variable
shape is ``{"content": {"b64": ...}, "shape": [n]}``, where the base64 bytes are, per element, a
4-byte little-endian length followed by the element's bytes.
"""
from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
from tritonclient.utils import serialize_byte_tensor


def bytes_elements_b64(elements: Sequence[bytes]) -> str:
    """Base64 of Triton's serialized BYTES tensor (``tritonclient.utils.serialize_byte_tensor``:
    ``<u32 little-endian length><bytes>`` per element)."""
    serialized = serialize_byte_tensor(np.array([bytes(e) for e in elements], dtype=np.object_))
    return base64.b64encode(serialized.item() if serialized.size else b"").decode()


def _bytes_input(elements: Sequence[bytes]) -> dict:
    return {"content": {"b64": bytes_elements_b64(elements)}, "shape": [len(elements)]}


def _strings_input(elements: Sequence[str]) -> dict:
    return {"content": list(elements), "shape": [len(elements)]}


def make_entry(
    text: str,
    *,
    video: bytes | None = None,
    images: Sequence[bytes] = (),
    video_url: str | None = None,
    image_urls: Sequence[str] = (),
    sampling: dict | None = None,
    stream: bool = True,
) -> dict:
    """One ``data`` entry: the same inputs :func:`client.api.request_tensors` sends."""
    entry: dict = {
        "text_input": [text],
        "sampling_parameters": [json.dumps(sampling or {})],
        "stream": [bool(stream)],
    }
    if video is not None:
        entry["video"] = _bytes_input([video])
    if images:
        entry["image"] = _bytes_input(list(images))
    if video_url is not None:
        entry["video_url"] = _strings_input([video_url])
    if image_urls:
        entry["image_url"] = _strings_input(list(image_urls))
    return entry


def make_input_data(
    text: str,
    *,
    videos: Sequence[bytes] = (),
    images: Sequence[bytes] = (),
    video_urls: Sequence[str] = (),
    image_urls: Sequence[str] = (),
    sampling: dict | None = None,
    stream: bool = True,
) -> dict:
    """``{"data": [entry, ...]}``: one entry per video or video URL, else one entry in all."""
    common = dict(images=images, image_urls=image_urls, sampling=sampling, stream=stream)
    entries = [make_entry(text, video=v, **common) for v in videos]
    entries += [make_entry(text, video_url=u, **common) for u in video_urls]
    return {"data": entries or [make_entry(text, **common)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.perf_analyzer.make_inputs",
                                description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--text", default="Describe this video in detail.")
    # extend: "--video a.mp4 --video b.mp4" and "--video a.mp4 b.mp4" both give two entries
    p.add_argument("--video", type=Path, nargs="+", action="extend", default=[], metavar="FILE")
    p.add_argument("--image", type=Path, nargs="+", action="extend", default=[], metavar="FILE")
    p.add_argument("--video-url", nargs="+", action="extend", default=[], metavar="PATH")
    p.add_argument("--image-url", nargs="+", action="extend", default=[], metavar="PATH")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-tokens", type=int)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (fixed-length benchmarks)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--fps", type=float)
    p.add_argument("--max-pixels", type=int)
    p.add_argument("--no-stream", action="store_true")
    args = p.parse_args(argv)
    keys = ("max_tokens", "min_tokens", "temperature", "seed", "fps", "max_pixels")
    sampling = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    if args.ignore_eos:
        sampling["ignore_eos"] = True
    data = make_input_data(
        args.text, videos=[f.read_bytes() for f in args.video], images=[f.read_bytes() for f in args.image],
        video_urls=args.video_url, image_urls=args.image_url, sampling=sampling, stream=not args.no_stream)
    args.output.write_text(json.dumps(data))
    print(f"wrote {args.output}: {len(data['data'])} entries", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
