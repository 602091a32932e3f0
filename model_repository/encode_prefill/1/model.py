"""Triton adaptor for the encode+prefill stage (backends/stages/encode_prefill_worker.py).

Input ``plan`` (JSON step plan from the orchestrator's scheduler); output ``result`` (JSON).
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root; the stub ignores PYTHONPATH


class TritonPythonModel:
    def initialize(self, args):
        from backends.triton import triton_io
        from backends.triton.replicas import replica_name
        from backends.runtime.loader import ModelSpec
        from backends.stages.device import helper_gpus, stage_setup
        from backends.stages.encode_prefill_worker import EncodePrefillWorker

        self.io = triton_io
        params, device = stage_setup(args)
        replica = triton_io.int_parameter(params, "replica", 0)
        self.worker = EncodePrefillWorker(
            ModelSpec.from_parameters(params, device=str(device)), device,
            attention_backend=params.get("attention_backend", "auto"),
            vision_devices=helper_gpus(triton_io.gpus_value("vision_gpus", params.get("vision_gpus", "own")), device),
            kv_pool=replica_name("kv_pool", replica), lm_weights=replica_name("lm_weights", replica),
            vision_parallel=params.get("vision_parallel", "data"),
            vision_tp_size=None if params.get("vision_tp_size", "all") == "all"
            else triton_io.int_value("vision_tp_size", params["vision_tp_size"]))
        self.weights_gauge = triton_io.WeightsGauge("encode_prefill", replica)
        self.weights_gauge.set(self.worker.weights_held)

    def execute(self, requests):
        io, pb = self.io, self.io.pb()
        responses = []
        for request in requests:
            if io.foreign(request):
                responses.append(io.error(io.INTERNAL_ONLY))
                continue
            try:
                result = self.worker.execute(json.loads(io.string(request, "plan")))
                responses.append(pb.InferenceResponse([io.json_tensor("result", result)]))
            except Exception as exc:  # a failed step is reported to the orchestrator, the worker lives on
                responses.append(io.error(f"encode_prefill: {type(exc).__name__}: {exc}", invalid_argument=False))
        self.weights_gauge.set(self.worker.weights_held)  # changes once, when the first step maps decode's copy
        return responses

    def finalize(self):
        from backends.triton.server_stop import before_exit

        self.worker.shutdown()
        self.weights_gauge.close()  # before the stub exits (triton-inference-server/server#8662)
        before_exit()
