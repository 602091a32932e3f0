"""The parts of ``bench/stress.py``: the request mix, one request's outcome, a server's health and the resident
memory of its processes.

The mix (request ``i``): every 20th carries a 16-frame 64x48 video, 4 of every 20 a 64x64 PNG, the rest are text
(5% / 20% / 75%); one in five of each kind is cancelled after 1 to 3 streamed responses.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from backends.triton.launcher import TritonServer
from backends.triton.stubs import crashed, dump_stacks
from client.api import Client, ServerError
from tests.media import make_image, make_video

CRASH_NEEDLES = ("Signal (", "Segmentation fault", "Fatal Python error")  # in the server log: a process crashed
MAX_TOKENS = 16  # each request's output tokens (ignore_eos): short streams, so many start and end per burst


@dataclass(frozen=True)
class Media:
    """The media the mix sends: a PNG's and a video file's bytes."""

    image: bytes
    video: bytes

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


def fault(server: TritonServer) -> str | None:
    """Why ``server`` is no longer whole, or None: tritonserver exited (the signal or status), a model's stub
    process that was there when it became ready is gone, or its log shows a crash (:data:`CRASH_NEEDLES`)."""
    if server.process.poll() is not None:
        return crashed(server.process.returncode) or "tritonserver exited with status 0"
    alive = sorted(server.stubs().values())
    missing = [m for m in sorted(server.ready_stubs.values()) if m not in alive]
    if missing:
        return f"the process of model {', '.join(missing)} has died"
    log = server.log_tail(2_000_000)
    return next((f"the server log shows {needle!r}" for needle in CRASH_NEEDLES if needle in log), None)


def rss_mb(pid: int) -> float | None:
    """Resident memory of process ``pid`` (MB, from /proc/PID/status VmRSS), or None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def server_rss_mb(server: TritonServer) -> dict[str, float]:
    """Resident memory (MB) of tritonserver and of each of its stubs, by name: ``tritonserver`` and the model
    (a second instance of a model gets ``#pid`` after its name)."""
    sample = {"tritonserver": rss_mb(server.process.pid)}
    for pid, model in sorted(server.stubs().items()):
        sample[model if model not in sample else f"{model}#{pid}"] = rss_mb(pid)
    return {name: round(mb, 1) for name, mb in sample.items() if mb is not None}


def growth(first: dict[str, float], last: dict[str, float]) -> dict[str, dict]:
    """Per process in both samples: ``start_mb``, ``end_mb`` and ``growth`` (``end / start - 1``, a fraction)."""
    return {name: {"start_mb": first[name], "end_mb": last[name], "growth": round(last[name] / first[name] - 1, 4)}
            for name in first if name in last}


def since(start: float) -> float:
    """Seconds since ``start`` (a ``time.perf_counter()`` reading), to 0.01 s."""
    return round(time.perf_counter() - start, 2)


def keep_log_tail(server: TritonServer, path: Path, chars: int = 60_000) -> None:
    """Ask the stubs still alive for their threads' stacks (faulthandler, into the server log), then write the
    log's last ``chars`` characters (Triton's own crash frames, the stubs' faulthandler output) to ``path``."""
    if server.process.poll() is None:
        dump_stacks(server.stubs())
    path.write_text(server.log_tail(chars))
