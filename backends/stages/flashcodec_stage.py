"""FlashCodec as a Triton model (``backends.triton.adaptor``): the worker, its per-path video counter, and its end
of the stage link (``backends.ipc.protocol``: ``MediaDecode`` streams one ``GroupReady`` per group as soon as its
patches are in the pool, ``MediaAbort``). Triton requests are refused: the model is internal."""
from __future__ import annotations

import threading

from backends.ipc.link import LinkServer, Reply
from backends.ipc.protocol import SERVER_FAULT, Call, GroupReady, MediaAbort, MediaDecode, StageFailure
from backends.runtime.families import ServedModel
from backends.stages.device import stage_setup
from backends.stages.flashcodec_worker import FlashCodecWorker
from backends.triton import triton_io
from backends.triton.server_stop import StopWatch, before_exit
from flashcodec.decoders import PATHS


class FlashCodecStage(triton_io.InternalModel):
    def __init__(self, args: dict):
        params, device = stage_setup(args)
        # the pool's rows are the served family's patch rows (preset, or the checkpoint's model_type)
        served = ServedModel.read(params.get("preset") or "tiny", params.get("model_path") or None)
        self.worker = FlashCodecWorker(
            device, num_pages=triton_io.int_parameter(params, "patch_pages"),
            page_size=triton_io.int_parameter(params, "patch_page_size"),
            threads=triton_io.int_parameter(params, "decode_threads"),
            patch_dim=served.family.patch_dim,
            gpus=triton_io.gpus_value("nvdec_gpus", params.get("nvdec_gpus", "own")),
            processes_per_gpu=triton_io.int_parameter(params, "nvdec_processes_per_gpu", 2))
        pb = triton_io.pb()
        self.videos = pb.MetricFamily("unifiedserve_videos_decoded_total", "videos decoded, by decode path (nvdec, "
                                      "cpu_parallel, cpu)", pb.MetricFamily.COUNTER)
        # path -> (its counter, the count it has been told); every path's series from 0, so that rate() sees the
        # first video and a dashboard shows the paths before one is taken
        self.video_metrics = {path: (self.videos.Metric(labels={"path": path}), 0) for path in PATHS}
        self.metrics_lock = threading.Lock()  # calls end on the decode threads
        # When the server stops, every decode ends after its current group (its call ends).
        self.watch = StopWatch(self.worker.stop)
        self.link = LinkServer("flashcodec", self._call)

    def _call(self, message: Call, reply: Reply) -> None:
        """One stage-link call (on the link's reader thread; submits only)."""
        if isinstance(message, MediaAbort):
            self.worker.abort(message.req_id)
            reply.end()
        elif isinstance(message, MediaDecode):
            def on_done(failure: StageFailure | None) -> None:
                try:
                    self._count_videos()
                finally:
                    reply.end(failure)

            def on_group(index: int, pages: list[int]) -> None:
                if not reply.send(GroupReady(index, tuple(pages))):  # the worker takes the pages back
                    raise ConnectionError("the orchestrator has gone: the group's patch pages go back to the pool")

            self.worker.submit(message.req_id, message.path or message.data, message.plan, on_group, on_done,
                               message.stamp)
        else:
            reply.end(StageFailure(SERVER_FAULT, f"flashcodec: no such call {type(message).__name__}"))

    def _count_videos(self) -> None:
        with self.metrics_lock:
            for path, count in self.worker.videos_per_path().items():
                metric, told = self.video_metrics.get(path) or (self.videos.Metric(labels={"path": path}), 0)
                if count > told:
                    metric.increment(count - told)
                self.video_metrics[path] = (metric, max(count, told))

    def finalize(self):
        self.watch.close()
        self.link.close()
        self.worker.shutdown()
        with self.metrics_lock:  # metrics alive when the stub exits crash it (triton-inference-server/server#8662)
            self.video_metrics, self.videos = {}, None
        before_exit()
