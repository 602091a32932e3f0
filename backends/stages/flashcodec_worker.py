"""The FlashCodec stage: media -> patches in the shared patch pool, streamed group by group.

The worker owns the patch pool. Each request names the pages the orchestrator granted per
temporal-patch group; the worker decodes (flashcodec.pipeline), writes each group's patch rows into
its pages and reports "group g ready" at once, so encoding can start before the video is decoded.
Decoding runs on a thread pool: ``execute()`` returns immediately (invariant 1).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from backends import shared_tensor
from flashcodec.errors import MediaError
from flashcodec.patch_pool import write_group
from flashcodec.pipeline import image_group, iter_video_groups, make_decoder
from flashcodec.sampling import ImagePlan, VideoPlan

log = logging.getLogger(__name__)
PATCH_DIM = 3 * 2 * 14 * 14  # channels x temporal_patch_size x patch x patch (Qwen2.5-VL)


def plan_to_json(plan: VideoPlan | ImagePlan) -> dict:
    return {"kind": "video" if isinstance(plan, VideoPlan) else "image", **dataclasses.asdict(plan)}


def plan_from_json(data: dict) -> VideoPlan | ImagePlan:
    cls = VideoPlan if data["kind"] == "video" else ImagePlan
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields})


class FlashCodecWorker:
    """``num_pages`` patch pages of ``page_size`` patch rows (1176 float32 values each)."""

    def __init__(self, device: torch.device, num_pages: int, page_size: int, threads: int):
        self.pool = shared_tensor.create("patch_pool", (num_pages, page_size, PATCH_DIM), torch.float32, device)
        # NVDEC on a GPU, else GOP-parallel PyAV processes, else sequential PyAV (logged, counted per video).
        self.choice = make_decoder(device)
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="flashcodec")
        self.cancelled: set[str] = set()
        self.lock = threading.Lock()

    def submit(self, request_id: str, media: bytes | str, plan: dict, pages: list[list[int]],
               on_group: Callable[[int], None], on_done: Callable[[str | None], None]) -> None:
        """Decode ``media`` (bytes, or a path the orchestrator checked) by ``plan`` into ``pages[g]`` for
        group g; ``on_group(g)`` after each group is written; ``on_done(error_message_or_None)`` last."""
        self.executor.submit(self._run, request_id, media, plan_from_json(plan), pages, on_group, on_done)

    def abort(self, request_id: str) -> None:
        """Stop after the group being decoded; the stream then ends (the orchestrator waits for that
        before it frees the request's patch pages)."""
        with self.lock:
            self.cancelled.add(request_id)

    def _run(self, request_id, media, plan, pages, on_group, on_done) -> None:
        error = None
        try:
            if isinstance(plan, VideoPlan):
                groups = iter_video_groups(media, plan, self.choice.decoder)
            else:  # an image_url arrives as a path the orchestrator checked
                data = media if isinstance(media, bytes) else open(media, "rb").read()
                groups = iter([(0, image_group(data, plan))])
            for index, patches in groups:
                with self.lock:
                    if request_id in self.cancelled:
                        break
                write_group(self.pool.tensor, pages[index], patches.to(self.pool.tensor.device))
                if self.pool.tensor.is_cuda:  # another process reads the pages once it hears "ready"
                    torch.cuda.current_stream(self.pool.tensor.device).synchronize()
                on_group(index)
        except MediaError as exc:
            error = str(exc)
        except Exception as exc:  # never kill the worker: report and go on
            log.exception("flashcodec failed on %s", request_id)
            error = f"flashcodec: {type(exc).__name__}: {exc}"
        finally:
            with self.lock:
                self.cancelled.discard(request_id)
            on_done(error)

    def videos_per_path(self) -> dict[str, int]:
        """Videos decoded so far per path ("nvdec", "cpu_parallel", "cpu"), for the metrics endpoint."""
        return self.choice.paths.snapshot()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.choice.close()
        self.pool.release()
