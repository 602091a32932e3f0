"""The FlashCodec stage: media -> patches in the shared patch pool, streamed group by group.

The worker owns the patch pool and its free list (backends/ipc/shared_pages.py), shared with the
orchestrator. It decodes (flashcodec.pipeline) and, once a temporal-patch group has been decoded, takes
that group's pages from the free list (waiting while the pool is full: back-pressure), writes the
group's patch rows into them and reports "group g ready in pages [...]" at once, so encoding can start
before the video is decoded; nothing is reserved ahead. Reported pages are the orchestrator's to
return; pages of a group that is not reported (abort, error) go back here. Decoding runs on a thread
pool: ``execute()`` returns immediately (invariant 1). Its threads are shared fairly between requests
(``flashcodec.fair_queue``: one queue per request, a free thread takes the next item of the request with
the fewest running), so a request of many large items cannot hold other requests' media back for more
than the first item to end (issue 18). When the server stops (``stop``), every decode ends after its
current group as if aborted, so each stream gets its final flag and the model can unload.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

import torch

from backends.ipc import shared_pages, shared_tensor
from backends.ipc.protocol import INVALID_INPUT, SERVER_FAULT, StageFailure
from flashcodec.errors import MediaError
from flashcodec.fair_queue import FairQueue
from flashcodec.patch_pool import pages_needed, write_group
from flashcodec.files import FileStamp, changed_since, read_regular
from flashcodec.pipeline import iter_image_groups, iter_video_groups, make_decoder
from flashcodec.families import MediaPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Item:
    """One media item waiting for a decode thread (``FlashCodecWorker.submit``'s arguments)."""

    media: bytes | str
    plan: MediaPlan
    on_group: Callable[[int, list[int]], None]
    on_done: Callable[[StageFailure | None], None]
    stamp: FileStamp | None

    def changed(self) -> str | None:
        """The error (``files.changed_since``) when the item is a path that is no longer the file the orchestrator
        checked and planned, else None: its plan's frames and sizes would be taken from another file, wrongly or,
        past that file's end, with a misleading error (a fresh user's test replaced a video by rename while
        requests named it: 19 of 120 failed with "frame index 29 is past the last frame")."""
        if self.stamp is None or isinstance(self.media, bytes):
            return None
        return changed_since(self.media, self.stamp, self.plan.kind)

    def check_unchanged(self) -> None:
        """Raises MediaError with `changed`'s error, if any."""
        if (changed := self.changed()) is not None:
            raise MediaError(changed)


class FlashCodecWorker:
    """``num_pages`` patch pages of ``page_size`` patch rows of ``patch_dim`` float32 values each (the served family's
    ``flashcodec.families.Family.patch_dim``: Qwen2.5-VL 1176, InternVL3 588). ``gpus``: the GPUs
    whose NVDEC sessions decode each video (``triton_io.gpus_value``; default the stage's own GPU);
    ``processes_per_gpu``: processes each GPU's sessions are split over (``pipeline.make_decoder``)."""

    def __init__(self, device: torch.device, num_pages: int, page_size: int, threads: int, patch_dim: int,
                 gpus: str | list[int] | None = None, processes_per_gpu: int = 1):
        # The free list first: the orchestrator maps it once the pool itself is published.
        self.free_pages = shared_pages.SharedPageList.create(shared_pages.path_for("patch_pool"), num_pages)
        self.pool = shared_tensor.create("patch_pool", (num_pages, page_size, patch_dim), torch.float32, device)
        self.page_size = page_size
        # NVDEC on a GPU, else GOP-parallel PyAV processes, else sequential PyAV (logged, counted per video).
        self.choice = make_decoder(device, gpus=gpus, processes_per_gpu=processes_per_gpu)
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="flashcodec")
        self.queue: FairQueue[str, _Item] = FairQueue(threads)  # items by request, waiting for a thread
        self.cancelled: set[str] = set()
        self.running: dict[str, int] = {}  # media items queued or being decoded per request
        self.closing = False  # set at stop: no thread may wait for pages that nobody frees any more
        self.lock = threading.Lock()
        self.futures: set[Future] = set()  # decodes submitted and not finished

    def submit(self, request_id: str, media: bytes | str, plan: MediaPlan,
               on_group: Callable[[int, list[int]], None], on_done: Callable[[StageFailure | None], None],
               stamp: FileStamp | None = None) -> None:
        """Decode ``media`` (bytes, or a path the orchestrator checked: ``stamp`` the file then, ``files.file_stamp``)
        by ``plan``; ``on_group(g, pages)`` once group g is written into ``pages`` of the patch pool (from then on
        the caller's to free); ``on_done(failure or None)`` last (``invalid_input`` when the media would not decode,
        or the file was replaced or rewritten after its check, before or while it was decoded). The item waits for a
        decode thread in its request's queue (``flashcodec.fair_queue``), after the request's earlier items."""
        with self.lock:
            self.running[request_id] = self.running.get(request_id, 0) + 1
            self.queue.put(request_id, _Item(media, plan, on_group, on_done, stamp))
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand each free decode thread the next item by the fair rule (on a submit, and when an item ends)."""
        while True:
            with self.lock:
                taken = self.queue.take()
                if taken is None:
                    return
                future = self.executor.submit(self._run, *taken)
                self.futures.add(future)
            future.add_done_callback(self._forget)

    def _forget(self, future: Future) -> None:
        with self.lock:
            self.futures.discard(future)

    def abort(self, request_id: str) -> None:
        """Stop after the group being decoded, also while waiting for pages; items not started are dropped.
        Each stream then ends (the orchestrator waits for that before it frees the request's patch pages)."""
        with self.lock:
            if request_id not in self.running:  # nothing to stop, and the mark would never be spent
                return
            self.cancelled.add(request_id)
            dropped = self.queue.drop(request_id)
        for item in dropped:
            self._end(request_id, item.on_done, None)

    def _is_cancelled(self, request_id: str) -> bool:
        with self.lock:
            return self.closing or request_id in self.cancelled

    def stop(self) -> None:
        """The server is stopping: every decode, running or queued, ends after its current group as if
        aborted (its pages taken and not reported go back), so its stream is closed. No error is sent: the
        orchestrator has failed the request itself."""
        with self.lock:
            self.closing = True
            dropped = self.queue.drain()
        for request_id, item in dropped:
            self._end(request_id, item.on_done, None)

    def _run(self, request_id: str, item: _Item) -> None:
        failure = None
        try:
            if self.closing:
                return
            item.check_unchanged()
            if item.plan.kind == "video":
                groups = iter_video_groups(item.media, item.plan, self.choice.decoder)
            else:  # an image_url arrives as a path the orchestrator checked
                data = item.media if isinstance(item.media, bytes) else read_regular(item.media, "image")
                groups = iter_image_groups(data, item.plan, self.pool.tensor.device)  # normalised where it goes
            for index, patches in groups:
                if not self._write(request_id, index, patches, item.on_group):
                    break  # aborted, or the server is stopping: the stream just ends
            else:  # a video's GOP readers open the path again as they run
                item.check_unchanged()
        except Exception as exc:  # never kill the worker: report and go on
            # a media error, or any fault on a file changed under the decoder (told as that change): the client's
            if (changed := item.changed()) is not None or isinstance(exc, MediaError):
                failure = StageFailure(INVALID_INPUT, changed or str(exc))
            else:
                log.exception("flashcodec failed on %s", request_id)
                failure = StageFailure(SERVER_FAULT, f"flashcodec: {type(exc).__name__}: {exc}")
        finally:
            with self.lock:
                self.queue.done(request_id)  # the thread is free: the next item may start
            self._end(request_id, item.on_done, failure)
            self._dispatch()

    def _end(self, request_id: str, on_done: Callable[[StageFailure | None], None],
             failure: StageFailure | None) -> None:
        """An item has ended, run or dropped: count it out of its request and end its stream."""
        with self.lock:
            self.running[request_id] -= 1
            if not self.running[request_id]:  # the request's last item: its abort mark is spent
                del self.running[request_id]
                self.cancelled.discard(request_id)
        try:
            on_done(failure)
        except Exception:  # the executor would drop it silently, and the stream would stay open
            log.exception("flashcodec could not end the stream of %s", request_id)

    def _write(self, request_id: str, index: int, patches: torch.Tensor, on_group) -> bool:
        """Take the decoded group's pages, write it, report it; False when the request was aborted."""
        if self._is_cancelled(request_id):
            return False
        need = pages_needed(patches.shape[0], self.page_size)
        pages = self.free_pages.wait_allocate(need, lambda: self._is_cancelled(request_id))
        if pages is None:
            return False
        try:
            write_group(self.pool.tensor, pages, patches.to(self.pool.tensor.device))
            if self.pool.tensor.is_cuda:  # another process reads the pages once it hears "ready"
                torch.cuda.current_stream(self.pool.tensor.device).synchronize()
            on_group(index, pages)
        except BaseException:  # not reported, so nobody else will return them
            self.free_pages.free(pages)
            raise
        return True

    def videos_per_path(self) -> dict[str, int]:
        """Videos decoded so far per path ("nvdec", "cpu_parallel", "cpu"), for the metrics endpoint."""
        return self.choice.paths.snapshot()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop decoding and wait (up to ``timeout_s`` seconds) for the decode threads, so that no callback
        runs after this returns; stop the decoder processes; release the pool and its free list."""
        self.stop()
        with self.lock:
            futures = list(self.futures)
        if wait(futures, timeout_s).not_done:
            log.warning("flashcodec: decode threads still running at shutdown")
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.choice.close()
        self.pool.release()
        self.free_pages.close()
