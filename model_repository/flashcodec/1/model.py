"""Triton adaptor for FlashCodec (backends/stages/flashcodec_worker.py).

The orchestrator drives it over the stage link (backends/ipc/link.py, socket ``flashcodec``), not BLS.
Op "decode", body ``{"request_id", "media": file bytes or None, "plan": {"media_plan", "path"}}`` (the path
is used when set): one reply ``(group, pages)`` per group (the patch pages it took for the group once
decoded) as soon as its patches are in the pool, then the end (with the error message when decoding failed).
Op "abort", body the request_id: stop its decodes. Triton requests are refused: the model is internal.
"""
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root; the stub ignores PYTHONPATH


class TritonPythonModel:
    def initialize(self, args):
        from backends.triton import triton_io
        from backends.triton.server_stop import StopWatch
        from backends.ipc.link import LinkServer
        from backends.stages.device import stage_setup
        from backends.stages.flashcodec_worker import FlashCodecWorker

        self.io = triton_io
        params, device = stage_setup(args)
        self.worker = FlashCodecWorker(
            device, num_pages=triton_io.int_parameter(params, "patch_pages"),
            page_size=triton_io.int_parameter(params, "patch_page_size"),
            threads=triton_io.int_parameter(params, "decode_threads"),
            gpus=triton_io.gpus_value("nvdec_gpus", params.get("nvdec_gpus", "own")),
            processes_per_gpu=triton_io.int_parameter(params, "nvdec_processes_per_gpu", 2))
        pb = triton_io.pb()
        self.videos = pb.MetricFamily("unifiedserve_videos_decoded", "videos decoded, by decode path (nvdec, "
                                      "cpu_parallel, cpu)", pb.MetricFamily.COUNTER)
        self.video_metrics = {}  # path -> (its counter, the count it has been told)
        self.metrics_lock = threading.Lock()  # on_done runs on the decode threads
        # When the server stops, every decode ends after its current group (its call ends).
        self.watch = StopWatch(self.worker.stop)
        self.link = LinkServer("flashcodec", self._call)

    def _call(self, op, body, call):
        """One stage-link call (on the link's reader thread; submits only)."""
        if op == "abort":
            self.worker.abort(body)
            call.end()
        elif op == "decode":
            plan = body["plan"]

            def on_done(error):
                try:
                    self._update_metrics()
                finally:
                    call.end(error)

            def on_group(index, pages):
                if not call.send((index, pages)):  # the worker takes the pages back
                    raise ConnectionError("the orchestrator has gone: the group's patch pages go back to the pool")

            self.worker.submit(body["request_id"], plan["path"] or body["media"], plan["media_plan"], on_group,
                               on_done)
        else:
            call.end(f"flashcodec: unknown op {op!r}")

    def execute(self, requests):
        return [self.io.error(self.io.INTERNAL_ONLY) for _ in requests]

    def _update_metrics(self):
        with self.metrics_lock:
            self._set_video_counts()

    def _set_video_counts(self):
        for path, count in self.worker.videos_per_path().items():
            metric, told = self.video_metrics.get(path) or (self.videos.Metric(labels={"path": path}), 0)
            if count > told:
                metric.increment(count - told)
            self.video_metrics[path] = (metric, max(count, told))

    def finalize(self):
        from backends.triton.server_stop import before_exit

        self.watch.close()
        self.link.close()
        self.worker.shutdown()
        with self.metrics_lock:  # metrics alive when the stub exits crash it (triton-inference-server/server#8662)
            self.video_metrics, self.videos = {}, None
        before_exit()
