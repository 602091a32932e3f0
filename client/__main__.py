"""Ask UnifiedServe one question and stream the answer to stdout (installed: ``unifiedserve-client ...``).

    python -m client [--url 127.0.0.1:8001] [--http 127.0.0.1:8000]
                     [--video FILE | --video-url PATH] [--image FILE]... [--image-url PATH]...
                     [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
                     [--fps F] [--max-pixels P] [--min-pixels P] [--num-frames N] [--max-tiles N] [--min-tiles N]
                     [--one-tile] [--no-stream]
                     [--timeout S] "question"

gRPC by default; ``--http`` uses generate_stream (SSE), whose JSON body carries files as base64 ``data:`` URLs
(``image_url`` / ``video_url``; for very large files gRPC, or a path the server reads, spares the base64). After
the answer one line goes to stderr:
``TTFT 123.4 ms, mean TBT 5.6 ms, N output tokens, finish_reason=stop``.
Exit code 0 on success, 1 with the server's message on stderr on an error, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import base64
import sys
from pathlib import Path

from client.api import DEFAULT_GRPC_URL, DEFAULT_MODEL, Client, GenerationResult, ServerError
from client.http_stream import generate_stream_http


def build_parser() -> argparse.ArgumentParser:
    # `python -m client`, or the installed console command under its own name (pyproject.toml)
    prog = "python -m client" if Path(sys.argv[0]).name == "__main__.py" else None
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("question")
    p.add_argument("--url", default=DEFAULT_GRPC_URL, help="gRPC host:port (default %(default)s)")
    p.add_argument("--http", metavar="HOST:PORT", help="use HTTP generate_stream at HOST:PORT instead of gRPC")
    p.add_argument("--model", default=DEFAULT_MODEL)
    media = p.add_mutually_exclusive_group()
    media.add_argument("--video", type=Path, metavar="FILE", help="send this video file's bytes")
    media.add_argument("--video-url", metavar="PATH", help="a video path (or file:// URL) the server may read")
    p.add_argument("--image", type=Path, action="append", default=[], metavar="FILE",
                   help="send this image file's bytes (repeat for several images)")
    p.add_argument("--image-url", action="append", default=[], metavar="PATH", help="repeatable")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--min-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--fps", type=float, help="video frames sampled per second")
    p.add_argument("--max-pixels", type=int, help="pixel budget per frame or image (Qwen2.5-VL)")
    p.add_argument("--min-pixels", type=int, help="smallest resized area of a frame or image, pixels (Qwen2.5-VL)")
    p.add_argument("--num-frames", type=int, help="frames (segments) sampled from a video (InternVL3)")
    p.add_argument("--max-tiles", type=int, help="most 448-pixel tiles of an image (InternVL3)")
    p.add_argument("--min-tiles", type=int, help="fewest 448-pixel tiles of an image (InternVL3)")
    p.add_argument("--one-tile", action="store_true",
                   help="an image as one tile, no grid nor thumbnail (InternVL3: dynamic_image_size false)")
    p.add_argument("--no-stream", action="store_true", help="ask for the whole text in one response")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S")
    return p


def sampling_from_args(args: argparse.Namespace) -> dict:
    """The sampling_parameters JSON object: only the options the user gave."""
    keys = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "fps", "max_pixels", "min_pixels",
            "num_frames", "max_tiles", "min_tiles")
    sampling = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    if args.ignore_eos:
        sampling["ignore_eos"] = True
    if args.one_tile:
        sampling["dynamic_image_size"] = False
    return sampling


def summary_line(r: GenerationResult) -> str:
    ttft = "n/a" if r.ttft_ms is None else f"{r.ttft_ms:.1f} ms"
    tbt = "n/a" if r.mean_tbt_ms is None else f"{r.mean_tbt_ms:.1f} ms"
    n = "?" if r.num_output_tokens is None else r.num_output_tokens
    return f"TTFT {ttft}, mean TBT {tbt}, {n} output tokens, finish_reason={r.finish_reason}"


def media_lines(r: GenerationResult) -> list[str]:
    """One line a media item of the result's ``media`` report (what the server did with it: size, frames in the file
    and used, grid, visual tokens), then what ``max_visual_tokens`` lowered (``visual_cap``), if anything."""
    lines = []
    for k, item in enumerate(r.media or (), 1):
        details = ", ".join(f"{key} {value}" for key, value in item.items() if key != "kind")
        lines.append(f"{item.get('kind', 'media')} {k}: {details}")
    if r.visual_cap:
        lines.append("visual_cap: " + ", ".join(f"{k} {v}" for k, v in r.visual_cap.items() if v is not None))
    return lines


def data_url(path: Path) -> str:
    """A file's bytes as a base64 ``data:`` URL (the server reads the media type from the bytes, not the URL)."""
    return "data:application/octet-stream;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def sent_as_url_note(args, message: str) -> str | None:
    """With ``--http``, ``--video`` / ``--image`` files travel as ``data:`` URLs in ``video_url`` / ``image_url``, the
    names the server's errors use: a line saying so under such an error, else None."""
    flags = [flag for flag, name, given in (("--video", "video_url", args.video), ("--image", "image_url", args.image))
             if args.http and given and name in message]
    return f"note: {' and '.join(flags)} files are sent to --http as data: URLs in " \
           f"{' and '.join(f[2:] + '_url' for f in flags)}" if flags else None


class _Printer:
    """Writes each text delta to stdout at once; remembers whether anything was written."""

    def __init__(self):
        self.wrote = False

    def __call__(self, s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()
        self.wrote = True

    def end_line(self) -> None:
        if self.wrote:
            sys.stdout.write("\n")
            sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sampling = sampling_from_args(args)
    printer = _Printer()
    try:
        if args.http:
            if args.no_stream:
                parser.error("--http always streams (generate_stream)")
            video_url = data_url(args.video) if args.video else args.video_url
            image_url = [data_url(f) for f in args.image] + args.image_url
            result = generate_stream_http(
                args.question, url=args.http, model=args.model, video_url=video_url,
                image_url=image_url or None, sampling=sampling, timeout_s=args.timeout, on_text=printer,
                return_output_ids=True)  # ids make the mean TBT per token (client/api.py)
        else:
            video = args.video.read_bytes() if args.video else None
            images = [f.read_bytes() for f in args.image] or None
            with Client(args.url, args.model) as client:
                result = client.generate(
                    args.question, video=video, image=images, video_url=args.video_url,
                    image_url=args.image_url or None, sampling=sampling, stream=not args.no_stream,
                    on_text=printer, timeout_s=args.timeout, return_output_ids=True)
    except (ServerError, TimeoutError, OSError) as e:
        printer.end_line()
        print(f"error: {e}", file=sys.stderr)
        if note := sent_as_url_note(args, str(e)):
            print(note, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the request is cancelled as the client closes (no traceback)
        printer.end_line()
        print("interrupted: the request was cancelled", file=sys.stderr)
        return 130
    printer.end_line()
    for line in media_lines(result):
        print(line, file=sys.stderr)
    print(summary_line(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
