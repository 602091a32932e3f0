"""GOP-parallel CPU decoding: one video's GOP tasks (`gop_plan`) decoded at once on a pool of PyAV processes."""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from typing import Iterator, Sequence

import numpy as np

from flashcodec.decoders import CpuDecoder, DecodePaths
from flashcodec.gop import map_for_indices
from flashcodec.gop_plan import MAX_GOP_SIZE, frames_in_order, plan_gop_tasks
from flashcodec.gop_pool import WorkerPool
from flashcodec.gop_reader import DemuxMismatch, GopJob
from flashcodec.probe import Source

log = logging.getLogger(__name__)
SHM = "/dev/shm"  # bytes sources become files here for the workers: memory, not disk
# Their name's start; a server sets its own (backends.triton.launcher), so that it can remove what a killed decoder left.
TMP_PREFIX_ENV = "FLASHCODEC_TMP_PREFIX"


@contextlib.contextmanager
def as_file(source: Source) -> Iterator[str]:
    """A path holding `source`: the path itself, or a temporary file (deleted on exit) for bytes, named
    `$FLASHCODEC_TMP_PREFIX...` (default `flashcodec-...`) in /dev/shm where there is one."""
    if not isinstance(source, bytes):
        yield str(source)
        return
    prefix = os.environ.get(TMP_PREFIX_ENV) or "flashcodec-"
    fd, path = tempfile.mkstemp(prefix=prefix, dir=SHM if os.path.isdir(SHM) else None)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(source)
        yield path
    finally:
        os.unlink(path)


class ParallelCpuDecoder:
    """FrameDecoder that decodes one video's GOP tasks in parallel on `workers` long-lived processes.

    Per video: `gop.analyse_bitstream` (one demux pass in this process), `gop_plan.plan_gop_tasks` (GOPs
    without a sampled frame skipped, tasks of at most `max_gop_size` decoded packets), then the tasks on the
    shared `gop_pool.WorkerPool` (videos decoded at once share it fairly: a free process takes the next task of
    the video with the fewest running) and the frames back in order as soon as the next part is decoded, at most
    `window` tasks (default 2 per worker) ahead of the consumer. Output equals `CpuDecoder`'s frame for frame
    (HxWx3 uint8, upright). Streams whose packets lack unique PTS, and a demuxer that disagrees with the map, are
    decoded by `CpuDecoder` instead. Raises what `CpuDecoder` raises, and MediaError naming the timeout when a
    task part takes over `part_timeout_s` s (its process is killed and replaced). Raises gop_pool.PoolUnavailable
    if the processes cannot start. Call `close()` to stop them.
    """

    path = "cpu_parallel"

    def __init__(self, workers: int | None = None, max_gop_size: int = MAX_GOP_SIZE, part_timeout_s: float = 60.0,
                 window: int | None = None, paths: DecodePaths | None = None):
        self.workers = workers or len(os.sched_getaffinity(0))
        self.max_gop_size = max_gop_size
        self.window = window or 2 * self.workers
        self.paths = paths or DecodePaths()
        self.pool = WorkerPool(self.workers, part_timeout_s)

    def close(self) -> None:
        self.pool.close()

    def decode(self, source: Source, frame_indices: Sequence[int]) -> Iterator[np.ndarray]:
        indices, bmap = map_for_indices(source, frame_indices)
        if bmap is None:
            return
        if not bmap.exact_timestamps:
            self.paths.count("cpu", "packets without unique, unbroken timestamps cannot be split into GOP tasks")
            yield from CpuDecoder().decode(source, indices)
            return
        self.paths.count(self.path)
        tasks = plan_gop_tasks(bmap, indices, self.max_gop_size, self.workers)
        done, key = 0, object()  # this decode's own queue in the pool
        with as_file(source) as path:
            try:
                submit = lambda task: self.pool.submit(path, GopJob.of(bmap, task), key)  # noqa: E731
                for frame in frames_in_order(tasks, indices, submit, self.window):
                    yield frame
                    done += 1
            except DemuxMismatch as exc:
                self.paths.count("cpu", f"the demuxer disagreed with the GOP map ({exc})")
                yield from CpuDecoder().decode(source, indices[done:])
