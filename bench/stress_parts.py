"""The parts of ``bench/stress.py``: the request mix, one request's outcome, a server's health and the resident
memory of its processes.

The mix (request ``i``): every 20th carries a 16-frame 64x48 video, 4 of every 20 a 64x64 PNG, the rest are text
(5% / 20% / 75%); one in five of each kind is cancelled after 1 to 3 streamed responses.
"""
from __future__ import annotations

import io
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
from PIL import Image

from backends.triton.launcher import TritonServer
from backends.triton.stubs import crashed, dead_stub, dump_stacks
from client.api import Client, ServerError
from tests.media import make_image, make_video

CRASH_NEEDLES = ("Signal (", "Segmentation fault", "Fatal Python error")  # in the server log: a process crashed
T = TypeVar("T")
MAX_TOKENS = 16  # each request's output tokens (ignore_eos): short streams, so many start and end per burst


@dataclass(frozen=True)
class Media:
    """The media the mix sends: a PNG's and a video file's bytes."""

    image: bytes
    video: bytes

    @staticmethod
    def noise_png(side: int, seed: int) -> bytes:
        """A ``side`` x ``side`` RGB PNG of random pixels, stored uncompressed: 3 * side**2 bytes and more."""
        pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "PNG", compress_level=0)
        return buffer.getvalue()

    @classmethod
    def small(cls) -> "Media":
        """A 64x64 PNG and a 16-frame 64x48 H.264 MP4 (25 fps)."""
        return cls(make_image(64, 64, "RGB", "PNG"), make_video(width=64, height=48, num_frames=16))


def kind_of(i: int) -> str:
    """Request ``i``'s kind: ``video`` (i % 20 == 0), ``image`` (i % 20 in 1..4) or ``text``."""
    slot = i % 20
    return "video" if slot == 0 else "image" if slot <= 4 else "text"


def cancel_after(i: int) -> int | None:
    """After how many streamed responses request ``i`` is cancelled (1 to 3), or None: one in five of each kind."""
    return None if (i // 20 + i) % 5 else 1 + (i // 5) % 3


def run_request(url: str, i: int, media: Media, timeout_s: float) -> tuple[str, str | None]:
    """Send request ``i`` of the mix over gRPC and wait for its end (at most ``timeout_s`` seconds); returns
    ``(outcome, error)``: ``completed``, ``cancelled`` (by this client, as planned) or ``error`` with the
    exception's type and message (the first 200 characters)."""
    kind = kind_of(i)
    payload = {"image": {"image": media.image}, "video": {"video": media.video}}.get(kind, {})
    try:
        with Client(url) as client:
            result = client.generate(f"Request {i}: describe it.", timeout_s=timeout_s,
                                     sampling={"max_tokens": MAX_TOKENS, "ignore_eos": True},
                                     cancel_after_responses=cancel_after(i), **payload)
    except (ServerError, TimeoutError) as exc:
        return "error", f"request {i} ({kind}): {type(exc).__name__}: {str(exc)[:200]}"
    return ("cancelled" if result.finish_reason == "cancelled" else "completed"), None


def at_once(work: Callable[[int], T], n: int) -> list[T]:
    """``work(0)`` to ``work(n - 1)``, all at once on threads of their own; their results in that order."""
    results: list = [None] * n

    def run(i: int) -> None:
        results[i] = work(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def fault(server: TritonServer) -> str | None:
    """Why ``server`` is no longer whole, or None: tritonserver exited (the signal or status), a model's stub
    process that was there when it became ready is gone, or its log shows a crash (:data:`CRASH_NEEDLES`)."""
    if server.process.poll() is not None:
        return crashed(server.process.returncode) or "tritonserver exited with status 0"
    if dead := dead_stub(server):
        return dead
    log = server.log_tail(2_000_000)
    return next((f"the server log shows {needle!r}" for needle in CRASH_NEEDLES if needle in log), None)


def memory_mb(pid: int) -> dict[str, float] | None:
    """Process ``pid``'s resident memory in MB from /proc/PID/status: ``rss`` (VmRSS) and its parts ``anon``
    (RssAnon: heap, the process's own) and ``shmem`` (RssShmem: shared memory it has touched, such as the Python
    backend's region, which Triton grows for large inputs and never shrinks); None when it is gone."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssShmem": "shmem"}
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    found = {fields[k]: round(int(v.split()[0]) / 1024, 1)
             for k, _, v in (line.partition(":") for line in lines) if k in fields}
    return found if len(found) == len(fields) else None


def server_memory_mb(server: TritonServer) -> dict[str, dict[str, float]]:
    """:func:`memory_mb` of tritonserver and of each of its stubs, by name: ``tritonserver`` and the model (a
    second instance of a model gets ``#pid`` after its name)."""
    sample = {"tritonserver": memory_mb(server.process.pid)}
    for pid, model in sorted(server.stubs().items()):
        sample[model if model not in sample else f"{model}#{pid}"] = memory_mb(pid)
    return {name: mb for name, mb in sample.items() if mb is not None}


def growth(first: dict[str, dict], last: dict[str, dict]) -> dict[str, dict]:
    """Per process in both :func:`server_memory_mb` samples: ``start_mb``, ``end_mb`` (resident) and ``growth``
    (``end / start - 1``, a fraction)."""
    return {name: {"start_mb": first[name]["rss"], "end_mb": last[name]["rss"],
                   "growth": round(last[name]["rss"] / first[name]["rss"] - 1, 4)} for name in first if name in last}


def since(start: float) -> float:
    """Seconds since ``start`` (a ``time.perf_counter()`` reading), to 0.01 s."""
    return round(time.perf_counter() - start, 2)


def keep_log_tail(server: TritonServer, path: Path, chars: int = 60_000) -> None:
    """Ask the stubs still alive for their threads' stacks (faulthandler, into the server log), then write the
    log's last ``chars`` characters (Triton's own crash frames, the stubs' faulthandler output) to ``path``."""
    if server.process.poll() is None:
        dump_stacks(server.stubs())
    path.write_text(server.log_tail(chars))
