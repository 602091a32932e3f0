"""The decode stage as a Triton model (``backends.triton.adaptor``): the decode worker, its metrics, and its end
of the stage link (``backends.ipc.protocol``: ``DecodeAttach``, ``DecodeAdmit``, ``DecodeAbort``, ``DecodePace``).
Triton requests are refused: the model is internal."""
from __future__ import annotations

import time

from backends.ipc.link import LinkServer, Reply
from backends.ipc.protocol import (SERVER_FAULT, Call, DecodeAbort, DecodeAdmit, DecodeAttach, DecodeGrow, DecodePace,
                                   StageFailure)
from backends.runtime.loader import ModelSpec
from backends.stages.decode_worker import DecodeWorker
from backends.stages.device import shared_weights_on, stage_setup
from backends.stages.kv_pool_size import memory_fraction
from backends.triton import triton_io
from backends.triton.histograms import Bins, CounterHistogram, HistogramSpec
from backends.triton.replicas import replica_name
from backends.triton.server_stop import StopWatch, before_exit


STEP_SECONDS = HistogramSpec(
    "unifiedserve_decode_step_seconds", "seconds of each decode step, from its launch (or from the last step's tokens "
    "on the host, if later) to its tokens on the host",
    (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0))
SEND_S = 1.0  # while steps run, seconds between sends to Triton


class StepMetrics:
    """The decode steps' Prometheus metrics, one series per replica: the histogram of step seconds (its ``_count`` is
    the number of steps) and the counter ``unifiedserve_decode_step_sequences_total`` (mean batch = it / the steps).
    Each update is a round trip to the Triton process, so steps are binned here and sent when the batch empties or
    ``SEND_S`` has passed (and at shutdown): a scrape lags by at most that while requests run."""

    def __init__(self, replica: int):
        pb = triton_io.pb()
        self.labels = {"replica": str(replica)}
        self.histogram = CounterHistogram(STEP_SECONDS, (self.labels,))
        # Families must outlive their metrics, so both are kept; Triton merges the replicas' equal families.
        self.family = pb.MetricFamily("unifiedserve_decode_step_sequences_total", "sequences in decode steps, summed",
                                      pb.MetricFamily.COUNTER)
        self.sequences = self.family.Metric(labels=self.labels)
        self.bins, self.pending_sequences, self.sent = Bins(STEP_SECONDS.bounds), 0, time.monotonic()

    def on_step(self, batch: int, elapsed: float, idle: bool) -> None:
        """``DecodeWorker``'s ``on_step`` (on its send thread only): a step of ``batch`` sequences took ``elapsed``
        seconds (batch 0: no step, the worker is ``idle``)."""
        if batch:
            self.bins.observe(elapsed)
            self.pending_sequences += batch
        if self.pending_sequences and (idle or time.monotonic() - self.sent >= SEND_S):
            self.flush()

    def flush(self) -> None:
        """Send the steps binned since the last send (nothing after ``close``)."""
        delta = self.bins.take()
        if delta is not None and self.family is not None:
            self.histogram.send(delta, self.labels)
            self.sequences.increment(self.pending_sequences)
        self.pending_sequences, self.sent = 0, time.monotonic()

    def close(self) -> None:
        """After the worker's shutdown (no more ``on_step``): send what is binned, then drop the metrics and their
        families (alive when the stub exits they crash it, triton-inference-server/server#8662)."""
        self.flush()
        self.histogram.close()
        self.sequences = self.family = None


class DecodeStage(triton_io.InternalModel):
    def __init__(self, args: dict):
        params, device = stage_setup(args)
        replica = triton_io.int_parameter(params, "replica", 0)
        self.step_metrics = StepMetrics(replica)
        self.worker = DecodeWorker(
            ModelSpec.from_parameters(params, device=str(device)), device,
            kv_pages=triton_io.int_parameter(params, "kv_pages"), kv_memory_fraction=memory_fraction(params, device),
            page_size=triton_io.int_parameter(params, "kv_page_size"),
            max_batch=triton_io.int_parameter(params, "max_batch"),
            attention_backend=params.get("attention_backend", "auto"),
            cuda_graphs=params.get("cuda_graphs", "auto"), on_step=self.step_metrics.on_step,
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
        elif isinstance(message, DecodeGrow):
            self.worker.grow(message.grants)
            reply.end()
        elif isinstance(message, DecodePace):
            try:
                self.worker.pace(message.interval_ms, message.for_ms)
            except (TypeError, ValueError) as exc:
                reply.end(StageFailure(SERVER_FAULT, f"decode: bad pacing {message}: {exc}"))
                return
            reply.end()
        else:
            reply.end(StageFailure(SERVER_FAULT, f"decode: no such call {type(message).__name__}"))

    def finalize(self):
        self.watch.close()
        self.link.close()
        self.worker.shutdown()
        self.step_metrics.close()
        self.weights_gauge.close()
        before_exit()
