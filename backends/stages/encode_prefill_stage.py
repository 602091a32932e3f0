"""The encode+prefill stage as a Triton model (``backends.triton.adaptor``): the worker, its weights gauge, and its
end of the stage link (``backends.ipc.protocol.StepPlan`` -> ``StepResult``). Steps run one at a time, in the order
they came, on a thread of their own (the link's reader only hands them over). Triton requests are refused: the
model is internal."""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from backends.ipc.link import LinkServer, Reply
from backends.ipc.protocol import SERVER_FAULT, Call, StageFailure, StepPlan
from backends.runtime.loader import ModelSpec
from backends.stages.device import helper_gpus, shared_weights_on, stage_setup
from backends.stages.encode_prefill_worker import EncodePrefillWorker
from backends.triton import triton_io
from backends.triton.replicas import replica_name
from backends.triton.server_stop import before_exit

log = logging.getLogger(__name__)


class EncodePrefillStage(triton_io.InternalModel):
    def __init__(self, args: dict):
        params, device = stage_setup(args)
        replica = triton_io.int_parameter(params, "replica", 0)
        self.worker = EncodePrefillWorker(
            ModelSpec.from_parameters(params, device=str(device)), device,
            attention_backend=params.get("attention_backend", "auto"),
            vision_devices=helper_gpus(triton_io.gpus_value("vision_gpus", params.get("vision_gpus", "own")), device),
            kv_pool=replica_name("kv_pool", replica),
            lm_weights=replica_name("lm_weights", replica) if shared_weights_on(params) else None,
            vision_parallel=params.get("vision_parallel", "data"),
            vision_tp_size=None if params.get("vision_tp_size", "all") == "all"
            else triton_io.int_value("vision_tp_size", params["vision_tp_size"]),
            prefill_graphs=params.get("prefill_graphs", "auto"), vision_graphs=params.get("vision_graphs", "auto"),
            sms_while_decoding=triton_io.int_parameter(params, "sms_while_decoding", 0),
            compile_layers=params.get("compile_layers", "auto"))
        self.weights_gauge = triton_io.WeightsGauge("encode_prefill", replica)
        self.weights_gauge.set(self.worker.weights_held)
        # the current CUDA device is per thread: the steps' thread works on the stage's
        initializer = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self.steps = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode-prefill", initializer=initializer)
        self.link = LinkServer(replica_name("encode_prefill", replica), self._call)

    def _call(self, message: Call, reply: Reply) -> None:
        """One stage-link call (on the link's reader thread; submits only)."""
        if isinstance(message, StepPlan):
            self.steps.submit(self._step, message, reply)
        else:
            reply.end(StageFailure(SERVER_FAULT, f"encode_prefill: no such call {type(message).__name__}"))

    def _step(self, plan: StepPlan, reply: Reply) -> None:
        try:
            result = self.worker.execute(plan)
        except Exception as exc:  # a failed step is reported to the orchestrator, the worker lives on
            log.exception("encode_prefill: step failed")
            reply.end(StageFailure(SERVER_FAULT, f"encode_prefill: {type(exc).__name__}: {exc}"))
            return
        reply.end(last=result)  # one message: the orchestrator's next step waits for it
        self.weights_gauge.set(self.worker.weights_held)  # changes once, when the first step maps decode's copy

    def finalize(self):
        self.link.close()  # no step is submitted after this
        self.steps.shutdown(wait=True)
        self.worker.shutdown()
        self.weights_gauge.close()  # before the stub exits (triton-inference-server/server#8662)
        before_exit()
