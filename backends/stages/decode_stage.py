"""The decode stage as a Triton model (``backends.triton.adaptor``): the decode worker, its metrics, and its end
of the stage link (``backends.ipc.protocol``: ``DecodeAttach``, ``DecodeAdmit``, ``DecodeAbort``). Triton requests
are refused: the model is internal."""
from __future__ import annotations

import time

from backends.ipc.link import LinkServer, Reply
from backends.ipc.protocol import SERVER_FAULT, Call, DecodeAbort, DecodeAdmit, DecodeAttach, StageFailure
from backends.runtime.loader import ModelSpec
from backends.stages.decode_worker import DecodeWorker
from backends.stages.device import shared_weights_on, stage_setup
from backends.stages.kv_pool_size import memory_fraction
from backends.triton import triton_io
from backends.triton.replicas import replica_name
from backends.triton.server_stop import StopWatch, before_exit


class StepCounters:
    """The decode steps' Prometheus counters (steps, seconds, sequences), one series per replica. Each increment
    is a round trip to the Triton process, so the steps' sums are sent when the batch empties or a second has
    passed (and at shutdown): a scrape lags by at most a second while requests run."""

    def __init__(self, replica: int):
        pb = triton_io.pb()
        # Families must outlive their metrics, so both are kept; Triton merges the replicas' equal families.
        self.families = [pb.MetricFamily(name, text, pb.MetricFamily.COUNTER) for name, text in (
            ("unifiedserve_decode_steps", "decode steps run"),
            ("unifiedserve_decode_step_seconds", "seconds spent in decode steps (each from its launch, or from the "
             "last step's tokens on the host if later, to its tokens on the host), summed"),
            ("unifiedserve_decode_step_sequences", "sequences in decode steps, summed (mean batch = this / steps)"))]
        self.series = [family.Metric(labels={"replica": str(replica)}) for family in self.families]
        self.pending, self.sent = [0, 0.0, 0], time.monotonic()

    def on_step(self, batch: int, elapsed: float, idle: bool) -> None:
        """``DecodeWorker``'s ``on_step`` (on its send thread only)."""
        if batch:
            for k, value in enumerate((1, elapsed, batch)):
                self.pending[k] += value
        if self.pending[0] and self.series and (idle or time.monotonic() - self.sent >= 1.0):
            for metric, value in zip(self.series, self.pending):
                metric.increment(value)
            self.pending, self.sent = [0, 0.0, 0], time.monotonic()

    def close(self) -> None:
        """Metrics alive when the stub exits crash it (triton-inference-server/server#8662): the metrics, then
        their families."""
        self.series, self.families = [], []


class DecodeStage(triton_io.InternalModel):
    def __init__(self, args: dict):
        params, device = stage_setup(args)
        replica = triton_io.int_parameter(params, "replica", 0)
        self.counters = StepCounters(replica)
        self.worker = DecodeWorker(
            ModelSpec.from_parameters(params, device=str(device)), device,
            kv_pages=triton_io.int_parameter(params, "kv_pages"), kv_memory_fraction=memory_fraction(params, device),
            page_size=triton_io.int_parameter(params, "kv_page_size"),
            max_batch=triton_io.int_parameter(params, "max_batch"),
            attention_backend=params.get("attention_backend", "auto"),
            cuda_graphs=params.get("cuda_graphs", "auto"), on_step=self.counters.on_step,
            compile_layers=params.get("compile_layers", "auto"), overlap_steps=params.get("overlap_steps", "auto"),
            kv_pool=replica_name("kv_pool", replica),
            lm_weights=replica_name("lm_weights", replica) if shared_weights_on(params) else None)
        self.weights_gauge = triton_io.WeightsGauge("decode", replica)
        self.weights_gauge.set(self.worker.weights_held)
        # When the server stops, the stream ends: the orchestrator sees it and fails what was left in decode.
        self.watch = StopWatch(self.worker.end_stream)
        self.link = LinkServer(replica_name("decode", replica), self._call)

    def _call(self, message: Call, reply: Reply) -> None:
        """One stage-link call (on the link's reader thread; enqueues only)."""
        if isinstance(message, DecodeAttach):
            reply.send(None)  # attached
            self.worker.attach(reply.send, reply.end)
        elif isinstance(message, DecodeAdmit):
            self.worker.admit(message)
            reply.end()
        elif isinstance(message, DecodeAbort):
            self.worker.abort(message.seq_id, reply.end)
        else:
            reply.end(StageFailure(SERVER_FAULT, f"decode: no such call {type(message).__name__}"))

    def finalize(self):
        self.watch.close()
        self.link.close()
        self.worker.shutdown()
        self.counters.close()
        self.weights_gauge.close()
        before_exit()
