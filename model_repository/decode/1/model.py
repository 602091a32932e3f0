"""Triton adaptor for the decode stage (backends/stages/decode_worker.py).

The orchestrator drives it over the stage link (backends/ipc/link.py, socket ``decode`` or ``decode_<r>``),
not BLS. Ops: "stream" (long-lived; a first empty reply once attached, then one reply per decode step with the
tokens of all running sequences: ``(seq_ids, token_ids, finish_reasons)``), "admit" (body: a sequence after
prefill; ended at once), "abort" (body: the seq_id; ended once the loop has dropped it, so its KV pages may be
reused). Triton requests are refused: the model is internal.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root; the stub ignores PYTHONPATH


def shared_weights_on(params: dict) -> bool:
    """The ``share_weights`` parameter: on (default) or off. Raises ValueError for anything else."""
    value = params.get("share_weights", "on")
    if value not in ("on", "off"):
        raise ValueError(f"share_weights must be on or off, got {value!r}")
    return value == "on"


class TritonPythonModel:
    def initialize(self, args):
        from backends.triton import triton_io
        from backends.triton.replicas import replica_name
        from backends.runtime.loader import ModelSpec
        from backends.triton.server_stop import StopWatch
        from backends.ipc.link import LinkServer
        from backends.stages.decode_worker import DecodeWorker
        from backends.stages.device import stage_setup

        self.io = triton_io
        params, device = stage_setup(args)
        replica = triton_io.int_parameter(params, "replica", 0)
        pb = triton_io.pb()
        series = []  # made once the worker exists: metrics alive when a stub exits crash it (server#8662)
        # Each increment is a round trip to the Triton process: the steps' sums are sent when the batch empties or
        # a second has passed (and at shutdown), so a scrape lags by at most a second while requests run.
        pending, sent = [0, 0.0, 0], [time.monotonic()]

        def on_step(batch, elapsed, idle):  # on the decode stage's send thread only
            if batch:
                for k, value in enumerate((1, elapsed, batch)):
                    pending[k] += value
            if pending[0] and (idle or time.monotonic() - sent[0] >= 1.0):
                for metric, value in zip(series, pending):
                    metric.increment(value)
                pending[:], sent[0] = [0, 0.0, 0], time.monotonic()

        self.worker = DecodeWorker(
            ModelSpec.from_parameters(params, device=str(device)), device,
            kv_pages=triton_io.int_parameter(params, "kv_pages"),
            page_size=triton_io.int_parameter(params, "kv_page_size"),
            max_batch=triton_io.int_parameter(params, "max_batch"),
            attention_backend=params.get("attention_backend", "auto"),
            cuda_graphs=params.get("cuda_graphs", "auto"), on_step=on_step,
            compile_layers=params.get("compile_layers", "auto"), overlap_steps=params.get("overlap_steps", "auto"),
            kv_pool=replica_name("kv_pool", replica),
            lm_weights=replica_name("lm_weights", replica) if shared_weights_on(params) else None)
        # Families must outlive their metrics, so both are kept.
        self.metric_families = [pb.MetricFamily(name, text, pb.MetricFamily.COUNTER) for name, text in (
            ("unifiedserve_decode_steps", "decode steps run"),
            ("unifiedserve_decode_step_seconds", "seconds spent in decode steps (each from its launch, or from the "
             "last step's tokens on the host if later, to its tokens on the host), summed"),
            ("unifiedserve_decode_step_sequences", "sequences in decode steps, summed (mean batch = this / steps)"))]
        # one family per name across the replicas' processes (Triton merges equal families), one series each
        series += [family.Metric(labels={"replica": str(replica)}) for family in self.metric_families]
        self.metric_series = series
        self.weights_gauge = triton_io.WeightsGauge("decode", replica)
        self.weights_gauge.set(self.worker.weights_held)
        # When the server stops, the stream ends: the orchestrator sees it and fails what was left in decode.
        self.watch = StopWatch(self.worker.end_stream)
        self.link = LinkServer(replica_name("decode", replica), self._call)

    def _call(self, op, body, call):
        """One stage-link call (on the link's reader thread; enqueues only)."""
        if op == "stream":
            call.send(None)  # attached
            self.worker.attach(lambda *step: call.send(step), call.end)
        elif op == "admit":
            self.worker.admit(body)
            call.end()
        elif op == "abort":
            self.worker.abort(body, call.end)
        else:
            call.end(f"decode: unknown op {op!r}")

    def execute(self, requests):
        return [self.io.error(self.io.INTERNAL_ONLY) for _ in requests]

    def finalize(self):
        from backends.triton.server_stop import before_exit

        self.watch.close()
        self.link.close()
        self.worker.shutdown()
        # Metrics alive when the stub exits crash it (triton-inference-server/server#8662): drop them here.
        self.metric_series.clear()  # the metrics, then their families
        self.metric_families = None
        self.weights_gauge.close()
        before_exit()
