"""A small image beside a request of many large ones (issue 18): the small one's time to first token alone and beside.

    python3 bench/fair_decode.py --out /tmp/fair-decode [--images 24] [--side 3000] [--runs 3]

Serves the default (tiny) model (flashcodec's ``decode_threads`` 4) with a ``side`` x ``side`` noise PNG and a 64x64
PNG in an allowed folder. Per run: the small request (``image_url`` naming the 64x64 PNG) alone; the big request
(``images`` ``image_url`` items naming the noise PNG, ``max_pixels`` 200704: decoding is costly, prompts stay short)
alone; then the big one and, ``--gap-s`` later, the small one. Besides times to first token, the small request's
``*_wait_s``: from its sending until flashcodec opens its file to decode it (inotify; the orchestrator's probe opens
it first), the part of its time this stage's fair share of decode threads bounds. Prints each run and writes
``<out>/fair_decode.json`` (seconds). ``small_beside_big`` is also the end-to-end test's
(tests/e2e/test_fair_decode.py).
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.triton.launcher import TritonServer  # noqa: E402
from backends.triton.ports import ServerPorts  # noqa: E402
from client.api import Client  # noqa: E402
from tests.e2e.file_opens import FileOpens  # noqa: E402
from tests.media import make_image  # noqa: E402

SAMPLING = {"max_tokens": 2, "temperature": 0}
BIG_SAMPLING = {**SAMPLING, "max_pixels": 200704}  # 1,024 patches (256 tokens) an image, whatever its size


def write_noise_png(path: Path, side: int) -> Path:
    """A ``side`` x ``side`` RGB PNG of random pixels (incompressible: decoding costs what its size says)."""
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG", compress_level=1)
    path.write_bytes(buffer.getvalue())
    return path


def small_ttft_s(url: str, small: Path) -> float:
    """The small request's time to first token (seconds); ``small`` names its image."""
    with Client(url) as client:
        return client.generate("Describe.", image_url=str(small), sampling=SAMPLING).ttft_ms / 1e3


def big_ttft_s(url: str, big: list[Path]) -> float:
    """The big request's time to first token (seconds): an item per path of ``big``."""
    with Client(url) as client:
        return client.generate("Compare.", image_url=[str(path) for path in big], sampling=BIG_SAMPLING,
                               timeout_s=600).ttft_ms / 1e3


def small_beside_big(url: str, small: Path, big: list[Path], between: Callable[[], None]) -> tuple[float, float]:
    """(small, big) times to first token (seconds) when the small request is sent once ``between()`` has returned,
    after the big one was sent."""
    big_result = {}

    def send_big() -> None:
        big_result["ttft_s"] = big_ttft_s(url, big)

    thread = threading.Thread(target=send_big)
    thread.start()
    between()
    small_s = small_ttft_s(url, small)
    thread.join(timeout=600)
    return small_s, big_result["ttft_s"]


def decode_wait_s(opens: FileOpens, small: Path, sent: float) -> float:
    """Seconds from ``sent`` until the second open of ``small`` after it (flashcodec's; the first is the probe)."""
    return [t for t, name in opens.events() if name == small.name and t >= sent][1] - sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the JSON and the server log")
    parser.add_argument("--images", type=int, default=24, help="items of the big request")
    parser.add_argument("--side", type=int, default=3000, help="the big PNG's width and height (pixels)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gap-s", type=float, default=0.3, help="seconds between the big request and the small one")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory() as media:
        big = [write_noise_png(Path(media) / "noise.png", args.side)] * args.images
        small = Path(media) / "small.png"
        small.write_bytes(make_image(64, 64, "RGB", "PNG"))
        ports = ServerPorts.unused()
        with TritonServer(ready_timeout_s=300, ports=ports, log_path=out / "server.log",
                          extra_env={"UNIFIEDSERVE_MEDIA_DIRS": media}) as server, FileOpens(Path(media)) as opens:
            url = f"127.0.0.1:{server.ports.grpc}"
            small_ttft_s(url, small)  # warm-up
            for k in range(args.runs):
                sent = time.monotonic()
                run = {"small_alone_s": small_ttft_s(url, small)}
                run["small_alone_wait_s"] = decode_wait_s(opens, small, sent)
                run["big_alone_s"] = big_ttft_s(url, big)
                marks = {}

                def between() -> None:
                    time.sleep(args.gap_s)
                    marks["sent"] = time.monotonic()

                run["small_beside_s"], run["big_beside_s"] = small_beside_big(url, small, big, between)
                run["small_beside_wait_s"] = decode_wait_s(opens, small, marks["sent"])
                runs.append(run)
                print(f"run {k}: " + ", ".join(f"{key} {value:.3f}" for key, value in run.items()), flush=True)
    (out / "fair_decode.json").write_text(json.dumps({**vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
