"""Triton adaptor for FlashCodec (backends/stages/flashcodec_worker.py).

op "decode": inputs request_id, media (file bytes, or a path when plan["path"] is set), plan (JSON:
the sampling plan); streams one response per group (outputs ``group`` and ``pages``, the patch pages
it took for the group once decoded) as soon as its patches are in the pool, then the final flag.
op "abort": stop request_id's decode.
"""
import json
import sys
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root; the stub ignores PYTHONPATH


class TritonPythonModel:
    def initialize(self, args):
        from backends import triton_io
        from backends.server_stop import StopWatch
        from backends.stages.device import stage_setup
        from backends.stages.flashcodec_worker import FlashCodecWorker

        self.io = triton_io
        params, device = stage_setup(args)
        self.worker = FlashCodecWorker(
            device, num_pages=triton_io.int_parameter(params, "patch_pages"),
            page_size=triton_io.int_parameter(params, "patch_page_size"),
            threads=triton_io.int_parameter(params, "decode_threads"),
            gpus=triton_io.gpus_value("nvdec_gpus", params.get("nvdec_gpus", "own")))
        pb = triton_io.pb()
        self.videos = pb.MetricFamily("unifiedserve_videos_decoded", "videos decoded, by decode path (nvdec, "
                                      "cpu_parallel, cpu)", pb.MetricFamily.COUNTER)
        self.video_metrics = {}  # path -> (its counter, the count it has been told)
        self.metrics_lock = threading.Lock()  # on_done runs on the decode threads
        # finalize() comes only once every decode stream has its final flag: end them when the server stops.
        self.watch = StopWatch(self.worker.stop)

    def execute(self, requests):
        io, pb = self.io, self.io.pb()
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            if io.foreign(request):
                sender.send(io.error(io.INTERNAL_ONLY), flags=final)
                continue
            request_id, op = io.string(request, "request_id"), io.string(request, "op")
            if op == "abort":
                self.worker.abort(request_id)
                sender.send(pb.InferenceResponse([]), flags=final)
                continue
            plan = json.loads(io.string(request, "plan"))
            media = plan["path"] if plan.get("path") else io.bytes_list(request, "media")[0]

            def on_group(index, pages, sender=sender):
                sender.send(pb.InferenceResponse([pb.Tensor("group", np.array([index], np.int32)),
                                                  pb.Tensor("pages", np.array(pages, np.int32))]))

            def on_done(error, sender=sender):
                try:
                    self._update_metrics()  # before the final flag: after it, finalize() may run
                finally:
                    if error:  # one message: the error carries the final flag
                        sender.send(io.error(error), flags=final)
                    else:
                        sender.send(flags=final)

            self.worker.submit(request_id, media, plan["media_plan"], on_group, on_done)
        return None

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
        from backends.server_stop import before_exit

        self.watch.close()
        self.worker.shutdown()
        with self.metrics_lock:  # metrics alive when the stub exits crash it (triton-inference-server/server#8662)
            self.video_metrics, self.videos = {}, None
        before_exit()
