"""The decode stage: a continuous-batching loop over every running sequence, in its own thread.

The worker owns the KV pool (allocated once, published for encode_prefill to map). The orchestrator
admits a sequence after its prefill (block table, first token, M-RoPE delta, sampling), and reads
ONE message per decode step carrying the new tokens of all running sequences (design.md, "Per-token
traffic"). Commands reach the loop through a queue, so ``execute()`` never blocks (invariant 1).
Sending a response is a round trip to the Triton process, so the loop hands each step's message to a send
thread and goes on with the next step, whose GPU work hides the send; messages leave in the order they were
made. (Sent between steps, with a metric update per step, the round trips cost 0.66 ms of a 6.2 ms batch-1
step on an H200: bench/results/serve-h200x2-2026-11-29.)
When the server stops, the stream is ended (``end_stream``) before ``finalize``: Triton unloads the
model only once that stream's sender has sent its final flag.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from backends import shared_tensor, shared_weights
from backends.runtime.attention import FlashInferAttentionBackend, make_backend
from backends.runtime.cuda_graphs import batch_ladder
from backends.runtime.kv_cache import RESERVED_KV_PAGES, KVCacheLayout
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.lm_fuse import fuse_projections
from backends.runtime.model_runner import DecodeSeq, ModelRunner
from backends.runtime.sampler import SamplingParams, sample_tensor, warm_up
from backends.runtime.stopping import finish_reason
from backends.runtime.tokenizer import eos_token_ids

log = logging.getLogger(__name__)

# (seq_ids, token_ids, finish_reasons): one decode step's output for all sequences ("" = running).
StepSink = Callable[[list[str], list[int], list[str]], None]
# (sequences in the step, seconds from the step's start to its tokens on the host, whether the batch is empty
# after it): one call per step, on the send thread after the step's message; also (0, 0.0, idle) when the batch
# may have emptied without a step (abort, end) and at shutdown.
StepTimer = Callable[[int, float, bool], None]


@dataclass
class RunningSeq:
    """A sequence in the decode batch. ``num_cached`` tokens are in the KV pool; ``last_token`` is not yet."""

    seq_id: str
    block_table: np.ndarray  # int32: the KV pages granted at admission (a step's page list is views of these)
    num_cached: int
    last_token: int
    mrope_delta: int
    num_generated: int
    max_tokens: int
    sampling: SamplingParams

    @classmethod
    def from_admit(cls, payload: dict) -> "RunningSeq":
        """From the orchestrator's admit message (see orchestrator/stages.py)."""
        return cls(payload["seq_id"], np.asarray(payload["block_table"], dtype=np.int32), int(payload["num_cached"]),
                   int(payload["last_token"]), int(payload["mrope_delta"]), int(payload["num_generated"]),
                   int(payload["max_tokens"]), SamplingParams(**payload["sampling"]))


class DecodeWorker:
    """Owns the KV pool and runs the decode loop thread.

    ``kv_pages`` KV pages of ``page_size`` tokens for sequences (the pool has ``RESERVED_KV_PAGES`` more);
    at most ``max_batch`` sequences per step. ``attention_backend``: see ``attention.make_backend``;
    ``cuda_graphs``: ``"auto"`` (capture decode graphs for batch sizes up to ``max_batch`` when the backend
    is flashinfer), ``"on"`` (the same, ValueError without flashinfer) or ``"off"``. ``compile_layers``: the
    decoder layers' small ops fused by ``torch.compile`` (``backends.runtime.lm_compile``; compiled by the
    graphs' warm-up at start): ``"auto"`` (with CUDA graphs: 5.47 vs 7.03 ms per step at batch 1 and 9.33 vs
    12.35 ms at batch 64, 4k context, on an H200: bench/results/runtime-fused-h200-2026-11-30), ``"on"`` or
    ``"off"``. ``on_step``: told each step's batch size and time (forward + sampling) and whether the batch is
    empty after it (``StepTimer``), for the stage's metrics (a metric update is a round trip to the Triton
    process: the adaptor sums them and sends them when the batch empties or a second has passed).
    ``kv_pool``: the shared pool's name (``backends.replicas``: one pool per replica). ``lm_weights``: the name
    under which the language model's weights are shared with encode_prefill (``backends.shared_weights``; None:
    not shared).
    """

    def __init__(self, spec: ModelSpec, device: torch.device, kv_pages: int, page_size: int, max_batch: int,
                 attention_backend: str = "auto", cuda_graphs: str = "auto", on_step: StepTimer | None = None,
                 compile_layers: str = "auto", kv_pool: str = "kv_pool", lm_weights: str | None = "lm_weights"):
        for name, value in (("cuda_graphs", cuda_graphs), ("compile_layers", compile_layers)):
            if value not in ("auto", "on", "off"):
                raise ValueError(f"{name} must be auto, on or off, got {value!r}")
        model, tokenizer = load_model(spec)
        fuse_projections(model.model.language_model)  # as ModelRunner would, but before the weights are shared
        # published before the KV pool, which encode_prefill waits for: by then it can find the weights too
        self.weights = shared_weights.publish(model, lm_weights, device) if lm_weights else None
        self.weights_held = shared_weights.held_bytes(model, self.weights)
        layout = KVCacheLayout.from_config(model.config, num_pages=kv_pages + RESERVED_KV_PAGES,
                                           page_size=page_size, dtype=model.dtype)
        self.pool = shared_tensor.create(kv_pool, layout.shape, layout.dtype, device)
        backend = make_backend(attention_backend, model.config, page_size, model.dtype, device)
        graphs = cuda_graphs == "on" or (cuda_graphs == "auto" and isinstance(backend, FlashInferAttentionBackend))
        compiled = compile_layers == "on" or (compile_layers == "auto" and graphs)
        self.runner = ModelRunner(model, self.pool.tensor, page_size, backend, compile_language_model=compiled)
        if graphs:
            self.runner.enable_cuda_graphs(batch_ladder(max_batch))
        log.info("decode: %s attention, CUDA graphs %s, decoder layers %s", type(backend).__name__,
                 "off" if self.runner.graphs is None else f"for batch sizes up to {max_batch}",
                 "compiled" if compiled else "eager")
        warm_up(device, model.lm_head.out_features)
        self.eos_ids = eos_token_ids(tokenizer)
        self.on_step = on_step
        self.max_batch = max_batch
        self.running: dict[str, RunningSeq] = {}
        self.commands: queue.Queue = queue.Queue()
        self.sink: StepSink | None = None
        self.end: Callable[[], None] | None = None  # ends the attached stream (sends its final flag)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # (callable, args) for the send thread; None stops it
        self._sender = threading.Thread(target=self._send_loop, name="decode-send", daemon=True)
        self._sender.start()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self.thread.start()

    # Called from execute() (or the server's stop watch): enqueue only.
    def attach(self, sink: StepSink, end: Callable[[], None]) -> None:
        """Send each step to ``sink`` from now on; ``end()`` (on the loop thread) closes that stream."""
        self.commands.put(("attach", sink, end))

    def end_stream(self) -> None:
        """The server is stopping: drop every running sequence (its requests are failed by the orchestrator,
        which sees the stream end) and end the stream, so that the model can unload."""
        self.commands.put(("end", None, None))

    def admit(self, payload: dict) -> None:
        self.commands.put(("admit", RunningSeq.from_admit(payload), None))

    def abort(self, seq_id: str, done: Callable[[], None]) -> None:
        """Drop ``seq_id``; ``done()`` runs on the loop thread once it no longer touches its KV pages."""
        self.commands.put(("abort", seq_id, done))

    def shutdown(self) -> None:
        """Stop the loop thread (after that no callback runs) and release the KV pool."""
        self._stop.set()
        self.commands.put(("stop", None, None))
        self.thread.join(timeout=10)
        if self.thread.is_alive():
            log.warning("decode: the loop thread did not stop within 10 s")
        self._told(0, 0.0)  # what the metrics have summed goes out before the model unloads
        self._outbox.put(None)
        self._sender.join(timeout=10)
        self.on_step = None
        self.pool.release()
        if self.weights is not None:
            self.weights.release()

    def _post(self, send: Callable, *args) -> None:
        """Run ``send(*args)`` on the send thread, after everything posted before it."""
        self._outbox.put((send, args))

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            send, args = item
            try:
                send(*args)
            except Exception:
                log.exception("decode could not send %s", getattr(send, "__name__", send))

    def _apply(self, command) -> None:
        kind, value, done = command
        if kind == "attach":
            self._end_stream()  # a stream replaced (a new orchestrator) is ended, not left open
            self.sink, self.end = value, done
        elif kind == "end":
            self.running.clear()
            self._end_stream()
            self._told(0, 0.0)
        elif kind == "admit":
            self.running[value.seq_id] = value
        elif kind == "abort":
            self.running.pop(value, None)
            done()
            self._told(0, 0.0)

    def _end_stream(self) -> None:
        end, self.sink, self.end = self.end, None, None
        if end is not None:
            self._post(end)

    def _loop(self) -> None:
        if self.runner.device.type == "cuda":  # the current device is per thread: this one's work is on the pool's
            torch.cuda.set_device(self.runner.device)
        try:
            self._serve()
        finally:
            self._end_stream()  # never left open: it would keep the model from unloading

    def _serve(self) -> None:
        while not self._stop.is_set():
            # Idle: block until a command arrives; busy: drain what is there and step.
            block = not self.running or self.sink is None
            try:
                self._apply(self.commands.get(block=block, timeout=None if block else 0))
                continue
            except queue.Empty:
                pass
            try:
                self._step()
            except Exception:  # a failed step must not kill the loop: end the batch, keep serving
                log.exception("decode step failed")
                failed = list(self.running)
                self.running.clear()
                self._post(self.sink, failed, [-1] * len(failed), ["error"] * len(failed))

    def _step(self) -> None:
        batch = list(self.running.values())[: self.max_batch]
        start = time.perf_counter()
        logits = self.runner.decode([
            DecodeSeq(s.last_token, s.num_cached + s.mrope_delta, s.num_cached, s.block_table) for s in batch
        ])
        tokens = sample_tensor(logits, [s.sampling for s in batch], [s.num_generated for s in batch], self.eos_ids)
        if self.runner.graphs is not None:  # plan the next step while the GPU runs this one
            try:
                self.runner.prepare_decode(self._next_layout(batch))
            except Exception:  # only a head start: the next step plans when it runs
                log.exception("decode: planning the next step ahead failed")
        tokens = tokens.tolist()
        elapsed = time.perf_counter() - start
        reasons = []
        for seq, token in zip(batch, tokens):
            seq.num_cached += 1
            seq.last_token = token
            seq.num_generated += 1
            reason = finish_reason(token, seq.num_generated, seq.max_tokens, seq.sampling.min_tokens,
                                   seq.sampling.ignore_eos, self.eos_ids)
            reasons.append(reason or "")
            if reason:
                del self.running[seq.seq_id]
        self._post(self.sink, [s.seq_id for s in batch], tokens, reasons)
        self._told(len(batch), elapsed)

    def _next_layout(self, batch: list[RunningSeq]) -> list[DecodeSeq]:
        """The next step's batch as it will be if no sequence of ``batch`` ends with an eos token and no command
        comes between the steps: the sequences that reach ``max_tokens`` leave, the others hold one more token
        (token ids and positions are left 0: a plan does not read them)."""
        stepped = {s.seq_id for s in batch}
        layout = []
        for s in self.running.values():
            if s.seq_id in stepped and s.num_generated + 1 >= s.max_tokens:
                continue
            layout.append(DecodeSeq(0, 0, s.num_cached + (s.seq_id in stepped), s.block_table))
            if len(layout) == self.max_batch:
                break
        return layout

    def _told(self, batch: int, elapsed: float) -> None:
        """``on_step`` on the send thread, after the step's message (``batch`` 0: no step, the batch may have
        emptied: a moment to send what the metrics have summed)."""
        if self.on_step is not None:
            self._post(self.on_step, batch, elapsed, not self.running)
