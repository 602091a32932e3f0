"""The decode stage: a continuous-batching loop over every running sequence, in its own thread.

The worker owns the KV pool (allocated once, published for encode_prefill to map). The orchestrator admits a
sequence after its prefill (block table, first token, M-RoPE delta, sampling), and reads ONE message per decode step
carrying the new tokens of all running sequences (``protocol.DecodeStep``). Commands reach the loop through a queue,
so the stage link's reader never blocks (docs/design.md, invariant 1). The loop hands each step's message (and the
metrics' round trips to the Triton process) to a send thread and goes on with the next step, whose GPU work hides
the send; messages leave in the order they were made (bench/RESULTS.md, "decode stage sends").

Steps overlap (vLLM's async scheduling, SGLang's overlap scheduler; with CUDA graphs, where the host's launches
would otherwise leave the GPU idle): the loop launches step N+1 with step N's tokens still on the device
(``backends.runtime.sampling.token_readback``) and only then reads step N's, so the GPU never waits for the host's
stop checks, messages and launches. A sequence whose ``max_tokens``-th token is in flight is not launched again; one
that ends with an eos token at step N has already been launched in step N+1, whose row for it is dropped. That step
still writes the sequence's KV pages, so the sequence's last message (on which the orchestrator frees them) goes out
with step N+1's. Abort, end and attach read the step in flight before they act, so an abort's ``done`` never runs
while a step still writes the sequence's pages; an admitted sequence joins the next step with its token from the
host. Penalized sequences' token counts are updated on the device from each step's tokens
(``backends.runtime.sampling.penalties``), so the step launched next already counts them. A structured output's mask
needs the token before: with one in the batch, step N is read after step N+1's forward is launched and before its
sampling, so the GPU runs the forward while the host reads, feeds the matchers and fills the masks. When the server
stops, the stream is ended (``end_stream``) before ``finalize``: Triton unloads the model only once that stream's
sender has sent its final flag.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from itertools import repeat
from typing import Callable

import torch

from backends.ipc import shared_tensor, shared_weights
from backends.ipc.protocol import DecodeAdmit, DecodeStep
from backends.runtime.attention import FlashInferAttentionBackend, make_backend
from backends.runtime.language_model.cuda_graphs import batch_ladder
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.language_model.fuse import fuse_projections
from backends.runtime.model_runner import DecodeSeq, ModelRunner
from backends.runtime.sampling import logprobs
from backends.runtime.sampling.grammar import Grammars, accepted
from backends.runtime.sampling.logit_bias import LogitBias
from backends.runtime.sampling.penalties import PenaltyState
from backends.runtime.sampling.sampler import sample_tensor, warm_up
from backends.runtime.sampling.stopping import finish_reason
from backends.runtime.sampling.token_readback import TokenReadback
from backends.runtime.tokenizer import eos_token_ids
from backends.stages.decode_grammars import GrammarCompiles
from backends.stages.decode_pace import Pacing
from backends.stages.decode_seqs import Launched, Row, RunningSeq, StepSink, StepTimer
from backends.stages.kv_pool_size import pool_layout
from backends.stages.send_thread import SendThread
from backends.triton.triton_io import choice_value, switched_on

log = logging.getLogger(__name__)



class DecodeWorker:
    """Owns the KV pool and runs the decode loop thread.

    ``kv_pages`` KV pages of ``page_size`` tokens for sequences (the pool has ``RESERVED_KV_PAGES`` more), or, with
    ``kv_memory_fraction`` (a CUDA device only: ``kv_pool_size.memory_fraction``), as many as that share of the GPU
    memory free once the weights are loaded holds (``kv_pool_size.pages_for_memory``); at most ``max_batch``
    sequences per step. ``attention_backend``: see ``attention.make_backend``; ``cuda_graphs``: ``"auto"`` (capture
    decode graphs for batch sizes up to ``max_batch`` when the backend is flashinfer), ``"on"`` (the same,
    ValueError without flashinfer) or ``"off"``. ``compile_layers``: the decoder layers' small ops fused by
    ``torch.compile`` (``backends.runtime.language_model.compile``; compiled by the graphs' warm-up at start):
    ``"auto"`` (with CUDA graphs; bench/RESULTS.md, "decode step, compiled layers"), ``"on"`` or ``"off"``.
    ``overlap_steps``: launch each step before reading the last one's tokens (module docstring): ``"auto"`` (with
    CUDA graphs, bench/RESULTS.md, "decode step, overlapped"; without them a step's planning waits for the device
    anyway, and on the CPU each message would come a step later), ``"on"`` or ``"off"``. ``on_step``: told each
    step's batch size and time (``StepTimer``) and whether the batch is empty after it, for the stage's metrics (a
    metric update is a round trip to the Triton process: the adaptor sums them and sends them when the batch empties
    or a second has passed). ``kv_pool``: the shared pool's name (``backends.triton.replicas``: one pool per
    replica). ``lm_weights``: the name under which the language model's weights are shared with encode_prefill
    (``backends.ipc.shared_weights``; None: not shared).
    """

    def __init__(self, spec: ModelSpec, device: torch.device, kv_pages: int, page_size: int, max_batch: int,
                 attention_backend: str = "auto", cuda_graphs: str = "auto", on_step: StepTimer | None = None,
                 compile_layers: str = "auto", kv_pool: str = "kv_pool", lm_weights: str | None = "lm_weights",
                 overlap_steps: str = "auto", kv_memory_fraction: float | None = None):
        for name, value in (("cuda_graphs", cuda_graphs), ("compile_layers", compile_layers),
                            ("overlap_steps", overlap_steps)):
            choice_value(name, value, name)
        model, tokenizer = load_model(spec, ("language_model",))  # no vision tower (meta: no memory)
        fuse_projections(model.model.language_model)  # as ModelRunner would, but before the weights are shared
        # published before the KV pool, which encode_prefill waits for: by then it can find the weights too
        self.weights = shared_weights.publish(model, lm_weights, device) if lm_weights else None
        self.weights_held = shared_weights.held_bytes(model, self.weights)
        layout = pool_layout(model.config, model.dtype, page_size, kv_pages, kv_memory_fraction, device)
        self.pool = shared_tensor.create(kv_pool, layout.shape, layout.dtype, device)
        backend = make_backend(attention_backend, model.config, page_size, model.dtype, device)
        graphs = switched_on(cuda_graphs, isinstance(backend, FlashInferAttentionBackend))
        compiled = switched_on(compile_layers, graphs)
        self.runner = ModelRunner(model, self.pool.tensor, page_size, backend, compile_language_model=compiled)
        if graphs:
            log.info("capturing CUDA graphs for batch sizes up to %d%s", max_batch,
                     " (the decoder layers are compiled first)" if compiled else "")
            self.runner.enable_cuda_graphs(batch_ladder(max_batch))
        self.overlap = switched_on(overlap_steps, graphs)
        log.info("decode: %s attention, CUDA graphs %s, decoder layers %s, steps %s", type(backend).__name__,
                 "off" if self.runner.graphs is None else f"for batch sizes up to {max_batch}",
                 "compiled" if compiled else "eager", "overlapped" if self.overlap else "one at a time")
        warm_up(device, model.lm_head.out_features)
        self.penalties = PenaltyState(model.lm_head.out_features, device)  # the loop thread's
        self.logit_bias = LogitBias()  # the loop thread's
        self.eos_ids = eos_token_ids(tokenizer)
        grammars = Grammars(tokenizer, model.lm_head.out_features, self.eos_ids, device)  # structured outputs
        self.on_step = on_step
        self.max_batch, self.page = max_batch, page_size
        self.running: dict[str, RunningSeq] = {}
        self.commands: queue.Queue = queue.Queue()
        self.compiles = GrammarCompiles(grammars, self.commands.put)  # structured outputs' matchers
        self._in_flight: Launched | None = None  # the loop thread's: the step whose tokens are not read yet
        self._held: list[Row] = []  # last rows waiting for the step in flight (_read)
        self._last_read = 0.0  # time.perf_counter() when the last step's tokens reached the host
        self._last_launch = 0.0  # time.perf_counter() when the last step was launched
        self._pacing = Pacing()
        self.sink: StepSink | None = None
        self.end: Callable[[], None] | None = None  # ends the attached stream (sends its final flag)
        self._sends = SendThread("decode-send")
        self._post = self._sends.post  # runs a callable on the send thread, after everything posted before it
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self.thread.start()

    # Called from execute() (or the server's stop watch): enqueue only.
    def attach(self, sink: StepSink, end: Callable[[], None]) -> None:
        """Send each step to ``sink``; ``end()`` (loop thread) closes that stream. A stream attached before (an
        orchestrator replaced) is ended, its sequences dropped: the new orchestrator counts their pages free."""
        self.commands.put(("attach", sink, end))

    def end_stream(self) -> None:
        """The server is stopping: drop every sequence and end the stream (the orchestrator fails their requests)."""
        self.commands.put(("end", None, None))

    def admit(self, admit: DecodeAdmit) -> None:
        """Queue the sequence (with a structured output, its grammar compiling meanwhile: ``decode_grammars``)."""
        self.commands.put(("admit", RunningSeq.from_admit(admit), self.compiles.start(admit)))

    def grow(self, grants: tuple[tuple[str, tuple[int, ...]], ...]) -> None:
        """Append KV pages to sequences' block tables (``DecodeGrow``); a sequence not held is skipped."""
        self.commands.put(("grow", grants, None))

    def pace(self, interval_ms: float, for_ms: float) -> None:
        """Launch steps ``interval_ms`` apart (0: one at a time, none spaced) for ``for_ms`` from now (0: end the
        pacing; ``decode_pace``), reading each step before the wait or the next launch. Raises ValueError for values
        that are not numbers (the loop thread must not fail)."""
        self.commands.put(("pace", (float(interval_ms), float(for_ms)), None))

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
        self._sends.close()
        self.on_step = None
        self.compiles.shutdown()
        self.pool.release()
        if self.weights is not None:
            self.weights.release()

    def _apply(self, command) -> None:
        kind, value, done = command
        if kind == "attach":
            if self.sink is not None:  # their requests end with the old stream
                self.running.clear()
                self.compiles.drop()
            self._end_stream()  # a stream replaced (a new orchestrator) is ended, not left open
            self.sink, self.end = value, done
        elif kind == "end":
            self.running.clear()
            self.compiles.drop()
            self._end_stream()
            self._told(0, 0.0)
        elif kind == "admit" and done is not None:  # its grammar compiles: it joins on "compiled" (decode_grammars)
            self.compiles.hold(value, done)
        elif kind == "compiled":
            seq, failed = self.compiles.ready(value)
            if failed:
                log.error("decode: could not admit %s: %s", value, failed)
                self._send([(value, -1, "error", None)])
            elif seq is not None:
                self._apply(("admit", seq, None))
        elif kind == "admit":
            self.running[value.seq_id] = value
            try:  # slots of sequences that have left are free again; its first token is its only output so far
                self.penalties.retain(self.running)
                self.penalties.add(value.seq_id, value.sampling, value.prompt_token_ids,
                                   (value.last_token,) if value.num_generated else ())
            except Exception:  # (the penalty tables could not grow): this sequence fails, the loop goes on
                log.exception("decode: could not admit %s", value.seq_id)
                del self.running[value.seq_id]
                self._send([(value.seq_id, -1, "error", None)])
        elif kind == "grow":
            for seq_id, pages in value:
                if (seq := self.running.get(seq_id) or self.compiles.waiting(seq_id)) is not None:
                    seq.extend(pages)
        elif kind == "pace":
            self._pacing = Pacing.starting(*value, time.perf_counter())
        elif kind == "abort":
            self.running.pop(value, None)
            self.compiles.drop(value)
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
            try:
                if self._in_flight is not None:  # not read, but finished before the pool is released
                    self._in_flight.tokens.wait()
            finally:
                self._end_stream()  # never left open: it would keep the model from unloading

    def _serve(self) -> None:
        while not self._stop.is_set():
            # Idle (no sequence may step: none, or each ending or waiting for a page): block until a command comes
            idle = self.sink is None or not self._batch()
            if idle or self._pacing.serial(time.perf_counter()):
                # paced: the step in flight goes out before the wait, which counts the read's time
                self._guarded(self._read_in_flight)
            wait = 0.0 if idle else self._pace_wait()
            try:
                command = self.commands.get(block=idle or wait > 0, timeout=None if idle else wait)
            except queue.Empty:
                self._guarded(self._step)
                continue
            if command[0] not in ("admit", "grow", "pace", "compiled"):  # abort, end, attach: read what writes pages
                self._guarded(self._read_in_flight)
            self._apply(command)

    def _pace_wait(self) -> float:
        """Seconds until the pacing lets the next step be launched (0: now)."""
        return self._pacing.wait_s(self._last_launch, time.perf_counter())

    def _guarded(self, work: Callable[[], None]) -> None:
        """``work()``; an error must not kill the loop: it is logged and fails the batch (:meth:`_fail_batch`)."""
        try:
            work()
        except Exception:
            log.exception("decode step failed")
            self._fail_batch()

    def _fail_batch(self) -> None:
        """After an error: wait for the device (it may write the batch's pages), read the step in flight if it can
        be, then fail every running sequence; rows held back for that step (:meth:`_read`) go out with them."""
        unread, self._in_flight = self._in_flight, None
        if self.runner.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.runner.device)
            except Exception:  # a broken context: the error already logged says why
                log.exception("decode: could not wait for the device after a failed step")
        if unread is not None:
            try:
                self._read(unread)
            except Exception:
                log.exception("decode: could not read the step in flight after a failed step")
        rows, self._held = self._held, []
        rows += [(seq_id, -1, "error", None) for seq_id in self.running]
        self.running.clear()
        self._send(rows)

    def _step(self) -> None:
        """Launch the next step, read the one before (with a structured output, between the step's forward and its
        sampling: ``_launch``), plan the step after while the GPU runs; without overlap, read it last."""
        previous = self._in_flight
        launched = self._launch()
        if self._in_flight is not previous:  # _launch has read it (a structured output in the batch)
            previous = None
        self._in_flight = launched
        if previous is not None:
            try:
                self._read(previous)
            except Exception:  # the step launched follows tokens never sent: not to be read (_fail_batch waits)
                self._in_flight = None
                raise
        if launched is not None and self.runner.graphs is not None:
            try:
                self.runner.prepare_decode(self._next_layout())
            except Exception:  # only a head start: the next step plans when it runs
                log.exception("decode: planning the next step ahead failed")
        if not self.overlap:
            self._read_in_flight()

    def _batch(self) -> list[RunningSeq]:
        """The next step's sequences: the running ones with a token left to make and a KV page for its token's KV
        (else it waits for ``grow``), in admission order, ``max_batch``."""
        return [s for s in self.running.values() if s.may_step(self.page)][:self.max_batch]

    def _launch(self) -> Launched | None:
        """Launch a step of :meth:`_batch` on the device (forward and sampling; nothing waits for the device) and
        advance its sequences' counts; None when no sequence has a token left to make. The token ids of the
        sequences in the step in flight come from the device, the others' (joining the batch) from the host."""
        batch = self._batch()
        if not batch:
            return None
        token_ids = None
        if self._in_flight is not None:
            rows = {id(s): i for i, s in enumerate(self._in_flight.seqs)}
            token_ids = self._in_flight.tokens.next_inputs([rows.get(id(s)) for s in batch],
                                                           [s.last_token for s in batch])
        started = self._last_launch = time.perf_counter()
        logits = self.runner.decode([
            DecodeSeq(s.last_token, s.num_cached + s.mrope_delta, s.num_cached, s.block_table) for s in batch
        ], token_ids)
        grammars = any(s.grammar is not None for s in batch)
        if grammars and self._in_flight is not None:  # its masks follow the step before: read it while this runs
            step, self._in_flight = self._in_flight, None
            self._read(step, after=batch)
        params = [s.sampling for s in batch]
        asking = logprobs.start(logits, params)  # the raw logits' (before the bias and the penalties)
        logits, penalized = self.penalties.penalize(self.logit_bias.apply(logits, params), (s.seq_id for s in batch))
        if grammars:  # not a sequence that has just ended (its matcher may be done): its token is dropped
            logits = self.compiles.grammars.mask(logits, [s.grammar if self.running.get(s.seq_id) is s else None
                                                          for s in batch])
        counts = [s.num_generated for s in batch]
        sampled = sample_tensor(logits, params, counts, self.eos_ids)
        self.penalties.count(penalized, sampled)  # on the device, before any later step is launched
        tokens = TokenReadback(sampled, logprobs.finish(*asking, sampled) if asking else None)
        for s in batch:
            s.num_cached += 1
            s.num_generated += 1
            s.ending = s.num_generated >= s.max_tokens
        return Launched(batch, counts, tokens, started, asking[0] if asking else None)

    def _read_in_flight(self) -> None:  # the step in flight, if there is one (_read)
        step, self._in_flight = self._in_flight, None
        if step is not None:
            self._read(step)

    def _read(self, step: Launched, after: list[RunningSeq] | None = None) -> None:
        """Bring ``step``'s tokens to the host (waits for the device), end the sequences that stop, send the step's
        message. Rows of sequences that ended before (an eos token in the step before) are dropped. The last row of a
        sequence that the step in flight (batch ``after`` while it is launched) still holds is sent with that step's
        message: the orchestrator frees a sequence's pages on its last message, and that step writes them."""
        later = after if after is not None else self._in_flight.seqs if self._in_flight is not None else ()
        tokens = step.tokens.tolist()
        now, read_s = time.perf_counter(), time.monotonic()
        elapsed, self._last_read = now - max(step.started, self._last_read), now
        rows, self._held = self._held, []
        figures = repeat(None) if step.asked is None else logprobs.rows(
            step.asked, step.tokens.figures(), [s.sampling for s in step.seqs])
        try:
            for seq, token, count, token_logprobs in zip(step.seqs, tokens, step.counts, figures):
                if self.running.get(seq.seq_id) is not seq:
                    continue
                seq.last_token = token
                reason = finish_reason(token, count + 1, seq.max_tokens, seq.sampling, self.eos_ids)
                if seq.grammar is not None:  # a match ended with its eos token, whatever ignore_eos says
                    reason = accepted(seq.grammar, token) or reason
                row = (seq.seq_id, token, reason or "", token_logprobs)
                if reason:
                    del self.running[seq.seq_id]
                    if any(s is seq for s in later):
                        self._held.append(row)
                        continue
                rows.append(row)
        except Exception:  # the rows made go out with the failure (_fail_batch): their sequences have left
            self._held = rows + self._held
            raise
        self._send(rows, read_s - (now - step.started), read_s)  # the launch on the monotonic clock
        self._told(len(step.seqs), elapsed)

    def _send(self, rows: list[Row], launched_s: float = 0.0, read_s: float = 0.0) -> None:
        """Post one ``DecodeStep`` of ``rows`` to the stream if attached, with the step's launch and read times."""
        if rows and self.sink is not None:
            seq_ids, token_ids, reasons, figures = map(tuple, zip(*rows))
            asked = figures if any(f is not None for f in figures) else ()
            self._post(self.sink, DecodeStep(seq_ids, token_ids, reasons, launched_s, read_s, asked))

    def _next_layout(self) -> list[DecodeSeq]:
        """The next step's batch if no sequence ends with an eos token and no command comes first (ids left 0)."""
        return [DecodeSeq(0, 0, s.num_cached, s.block_table) for s in self._batch()]

    def _told(self, batch: int, elapsed: float) -> None:
        """``on_step`` on the send thread, after the step's message (``batch`` 0: no step; the batch may be empty), with
        whether no sequence may step now (none running, or each ending or waiting for a KV page): the stage sends the
        metrics it has summed then, not after a wait for pages."""
        if self.on_step is not None:
            self._post(self.on_step, batch, elapsed, not any(s.may_step(self.page) for s in self.running.values()))
