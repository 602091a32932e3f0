"""The encode+prefill stage: executes one scheduler step plan from the orchestrator.

A plan (``backends.ipc.protocol.StepPlan``, the orchestrator's scheduler's output) has five parts, run in this
order:
* ``finished``: requests that ended (finished, failed or cancelled): their state is dropped;
* ``evict``: encoder-cache entries to drop;
* ``new``: prompts seen for the first time: token ids, media grids; the worker computes the rotary positions once
  (the model family's ``prompt_positions``: Qwen2.5-VL's M-RoPE via transformers' ``get_rope_index``, InternVL3's
  1-D positions) and keeps them with the ids and the embeddings of groups kept in its encoder cache
  (``prompt_state.PromptState``); nothing is embedded yet;
* ``encode``: whole temporal-patch groups (InternVL3: tiles): patches are read from the shared patch pool pages,
  laid out for the family's vision encoder (its ``pixels_from_patch_rows``), run through it, and their embeddings
  kept for the group's visual-token rows (and in the encoder cache when the work names a key);
* ``prefill``: prompt chunks ``[start, end)`` embedded (their text rows, then their groups' visual rows:
  ``PromptState.chunk``; a cached prefix is never embedded) and written into the shared KV pool (block tables
  given); the chunk that ends a prompt yields its first sampled token (its repetition penalty over the prompt
  applied, and its structured output's mask: ``backends.runtime.sampling.grammar``), with the stop rule's finish
  reason.
The runtime decides nothing: what runs in a step is the orchestrator's scheduler's call.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from backends.ipc import shared_tensor, shared_weights
from backends.ipc.protocol import EncodeWork, FirstToken, NewRequest, PrefillWork, StepPlan, StepResult
from backends.runtime import model_parts
from backends.runtime.attention import FlashInferAttentionBackend, make_backend
from backends.runtime.attention.flashinfer_backend import flashinfer_supports
from backends.runtime.families.registry import family_for
from backends.runtime.language_model.fuse import fuse_projections
from backends.runtime.language_model.compile import WARM_UP_TOKENS, warm_up_compiled
from backends.runtime.language_model.kv_cache import head_dim
from backends.runtime.loader import ModelSpec, checkpoint_bytes, host_available_bytes, load_model
from backends.runtime.model_runner import ModelRunner, PrefillChunk
from backends.runtime.phase_clock import PhaseClock
from backends.runtime.sampling import logprobs
from backends.runtime.sampling.grammar import Grammars, accepted
from backends.runtime.sampling.logit_bias import apply_logit_bias
from backends.runtime.sampling.penalties import penalize_first_tokens
from backends.runtime.sampling.sampler import sample_tensor, warm_up
from backends.runtime.sampling.stopping import finish_reason
from backends.runtime.sampling.token_readback import TokenReadback
from backends.runtime.tokenizer import eos_token_ids
from backends.stages.prompt_state import PromptState
from backends.stages.step_streams import StepStreams
from backends.triton.triton_io import choice_value, switched_on
from flashcodec.patch_pool import read_group

log = logging.getLogger(__name__)


HOST_WAIT_S = 900.0  # the longest encode_prefill waits for decode's load before reading the checkpoint anyway


def _wait_for_room_on_the_host(model_path: str, lm_weights: str) -> None:
    """Both stages read a checkpoint whole on the host (``loader.load_model``): where two reads at once would not fit
    the host's available memory (InternVL3-38B: 77 GB each), wait until decode has loaded and shared its weights (its
    read let go) or :data:`HOST_WAIT_S` has passed."""
    size, available = checkpoint_bytes(model_path), host_available_bytes()
    if available is None or 2 * size <= available:
        return
    log.info("encode_prefill: waiting for decode to load and share its weights before reading %s (%.1f GB; the "
             "host has %.1f GB available, not enough for both reads at once)", model_path, size / 1e9, available / 1e9)
    try:
        shared_tensor.describe(lm_weights, timeout_s=HOST_WAIT_S)
    except TimeoutError:
        log.warning("encode_prefill: decode shared no weights within %.0f s: reading the checkpoint now", HOST_WAIT_S)


class EncodePrefillWorker:
    """Maps the KV pool (owner: decode) and the patch pool (owner: flashcodec) lazily, on first use.

    ``attention_backend``: the prefill attention (see ``attention.make_backend``); ``vision_devices``: more
    devices for the vision tower: with ``vision_parallel`` "data" each holds a copy and each step's encode work
    is spread over them, with "tensor" the tower is split over them (``ModelRunner``'s ``vision_tp``), in towers
    of ``vision_tp_size`` GPUs each (None: all; fewer: hybrid, data parallel over the towers);
    ``kv_pool``: the name of the decode stage's pool to write (``backends.triton.replicas``); ``lm_weights``: the name
    of the decode stage's shared language-model weights, used in place of this stage's own copy when published
    (``backends.ipc.shared_weights``). ``prefill_graphs``: CUDA graphs for prefill chunks of one sequence of up to
    512 tokens (``backends.runtime.language_model.prefill_graphs``), captured with the runner at the first step (a
    capture that fails fails that step; later steps run eagerly): ``"auto"`` (when the attention backend is
    flashinfer: on CUDA, off on the CPU), ``"on"`` (ValueError here when flashinfer cannot run, naming why) or
    ``"off"``. ``compile_layers``: the decoder layers' small ops fused by ``torch.compile``
    (``backends.runtime.language_model.compile``; compiled at the first step, before the prefill graphs' capture, by
    a forward of ``WARM_UP_TOKENS`` tokens and, without prefill graphs, one of a single token, torch's 0/1
    specialisation; a compile that fails is logged and the layers run eagerly; on a GPU decode compiled the same
    layers at its start, whose inductor cache this compile finds): ``"auto"``
    (with flashinfer attention, as ``prefill_graphs``; a 2,048-token chunk 49.2 ms against 59.4 eager on the H200:
    bench/RESULTS.md, "prefill, compiled layers"), ``"on"`` or ``"off"``. ``sms_while_decoding``: SMs (an int; 0,
    the default, is off) that a step the orchestrator marks ``fewer_sms`` may use, on a CUDA green context's stream
    (``backends.stages.step_streams``, ``orchestrator.fewer_sms``; other steps use the whole GPU); checked before the
    model loads.
    ``vision_graphs``: CUDA graphs of the vision tower per item grid, captured as grids recur
    (``backends.runtime.vision.graphs``): ``"auto"`` (on where they can run: a CUDA device, one tower, a family that
    has them), ``"on"`` (ValueError here where they cannot, naming why) or ``"off"``. Raises ValueError for other
    values of the options."""

    def __init__(self, spec: ModelSpec, device: torch.device, attention_backend: str = "auto",
                 vision_devices: list[torch.device] | tuple = (), kv_pool: str = "kv_pool",
                 lm_weights: str = "lm_weights", vision_parallel: str = "data", vision_tp_size: int | None = None,
                 prefill_graphs: str = "auto", sms_while_decoding: int = 0, vision_graphs: str = "auto",
                 compile_layers: str = "auto"):
        choice_value("prefill_graphs", prefill_graphs, "prefill_graphs")
        choice_value("compile_layers", compile_layers, "compile_layers")
        choice_value("vision_graphs", vision_graphs, "vision_graphs")
        choice_value("vision_parallel", vision_parallel, "vision_parallel")
        if vision_tp_size is not None and vision_parallel != "tensor":
            raise ValueError(f"vision_tp_size {vision_tp_size} needs vision_parallel=tensor")
        self.streams = StepStreams(device, sms_while_decoding)
        self.vision_parallel, self.vision_tp_size = vision_parallel, vision_tp_size
        # with weights to share, the language model gets no memory (meta) until the first step maps decode's copy:
        # two copies of InternVL3-38B's 61 GiB would not fit one H200 at start
        if lm_weights and spec.load_format == "auto" and spec.model_path:
            _wait_for_room_on_the_host(spec.model_path, lm_weights)
        self.model, tokenizer = load_model(spec, ("vision",) if lm_weights else model_parts.PARTS)
        self.spec = spec
        self.family = family_for(self.model.config)
        fuse_projections(self.model.model.language_model)  # as ModelRunner would; decode shares fused weights
        if vision_parallel == "tensor":  # at load, not at the first step, where the split tower is made
            try:
                self.family.check_vision_tensor_parallel(self.model.config, 1 + len(vision_devices),
                                                         vision_tp_size or 1 + len(vision_devices))
            except ValueError as exc:
                raise ValueError(f"vision_parallel=tensor, vision_tp_size {vision_tp_size}: {exc}") from None
        self.device = device
        if prefill_graphs == "on":  # at load, not at the first step, where the graphs are captured
            reason = ("attention_backend is torch" if attention_backend == "torch"
                      else flashinfer_supports(head_dim(self.model.config), self.model.dtype, device))
            if reason:
                raise ValueError(f"prefill_graphs=on needs the flashinfer attention backend: {reason}")
        self.prefill_graphs, self.compile_layers = prefill_graphs, compile_layers
        why_not = ("the device is not a GPU" if device.type != "cuda" else "the tower is on several GPUs"
                   if vision_devices else None if self.family.graphed_vision
                   else f"the {self.family.name} vision tower has none")
        if vision_graphs == "on" and why_not:
            raise ValueError(f"vision_graphs=on: {why_not}")
        self.vision_graphs = vision_graphs != "off" and not why_not
        warm_up(device, self.model.lm_head.out_features)
        self.attention_backend = attention_backend
        self.vision_devices = list(vision_devices)
        self.kv_pool, self.lm_weights = kv_pool, lm_weights
        self._weights = None  # the shared weights once adopted (kept referenced)
        # language-model weight bytes by copy (shared_weights.held_bytes), updated when the first step maps decode's
        self.weights_held = shared_weights.held_bytes(self.model, None)
        self.eos_ids = eos_token_ids(tokenizer)
        self.grammars = Grammars(tokenizer, self.model.lm_head.out_features, self.eos_ids, device)  # structured outputs
        self._compiles = ThreadPoolExecutor(1, "grammar")  # a prompt's, from its registration: beside its steps
        self.prompts: dict[str, PromptState] = {}
        # merged visual embeddings [tokens, hidden] by key, kept and dropped as the orchestrator's plans say
        # (orchestrator/encoder_cache.py decides; nothing is evicted here)
        self.encoder_cache: dict[bytes, torch.Tensor] = {}
        self._runner: ModelRunner | None = None
        self._no_language_model = ""  # why the fallback could not build one (runner), once it failed
        self._patches: torch.Tensor | None = None

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            kv = shared_tensor.open_(self.kv_pool).tensor  # [layers, 2, pages, page_size, kv_heads, head_dim]
            # before any forward
            self._weights = shared_weights.adopt(self.model, self.lm_weights, self.device) if self.lm_weights else None
            if self._weights is None and any(p.is_meta for _, p in shared_weights.lm_parameters(self.model)):
                if self._no_language_model:
                    raise RuntimeError(self._no_language_model)
                try:
                    self._build_language_model()
                except Exception as exc:  # e.g. out of memory beside decode's KV pool: every later step says so
                    self._no_language_model = (f"encode_prefill has no language model: decode's copy could not be "
                                               f"mapped and its own could not be made ({type(exc).__name__}: {exc})")
                    raise RuntimeError(self._no_language_model) from exc
            self.weights_held = shared_weights.held_bytes(self.model, self._weights)
            backend = make_backend(self.attention_backend, self.model.config, kv.shape[3], self.model.dtype,
                                   self.device)
            split = self.vision_parallel == "tensor"
            flashinfer = isinstance(backend, FlashInferAttentionBackend)
            compiled = switched_on(self.compile_layers, flashinfer)
            self._runner = ModelRunner(self.model, kv, kv.shape[3], backend,
                                       vision_devices=() if split else self.vision_devices,
                                       vision_tp=self.vision_devices if split else (),
                                       vision_tp_size=self.vision_tp_size, compile_language_model=compiled)
            graphed = switched_on(self.prefill_graphs, flashinfer)
            if compiled:  # now, before the graphs' capture: a compile that fails leaves the layers eager
                failed = warm_up_compiled(self._runner, (WARM_UP_TOKENS,) if graphed else (WARM_UP_TOKENS, 1))
                if failed:
                    log.warning("encode_prefill: compiling the decoder layers failed, they run eagerly: %s", failed)
                    compiled = False
            if graphed:
                started = time.perf_counter()  # a capture that fails fails this step; later ones run eagerly
                self._runner.enable_prefill_graphs()
                log.info("encode_prefill: prefill CUDA graphs for one sequence's chunks of %s tokens, captured in "
                         "%.1f s%s", "/".join(map(str, self._runner.prefill_graphs.rungs)),
                         time.perf_counter() - started, " (the decoder layers compiled first)" if compiled else "")
            if self.vision_graphs:
                self._runner.enable_vision_graphs()
            log.info("encode_prefill: %s attention, decoder layers %s, prefill graphs %s, vision graphs %s",
                     type(backend).__name__, "compiled" if compiled else "eager",
                     "on" if self._runner.prefill_graphs is not None else "off",
                     "on" if self._runner.vision_graphs is not None else "off")
        return self._runner

    def _build_language_model(self) -> None:
        """This stage's own language model, as decode built or loaded it (``model_parts``: the same values):
        decode's copy could not be mapped (``shared_weights.adopt`` logged why). Built or loaded, fused, and its
        tensors given to this stage's model, whose language model was fused without memory (its buffers have it)."""
        log.warning("encode_prefill: building its own copy of the language model")
        built, _ = load_model(self.spec, ("language_model",))
        fuse_projections(built.model.language_model)
        shared_weights.rebind(self.model, {name: p.data for name, p in shared_weights.lm_parameters(built)})

    def shutdown(self) -> None:
        """Stop the vision helpers, if the runner was made, and the grammars' thread."""
        self._compiles.shutdown(wait=False, cancel_futures=True)
        if self._runner is not None:
            self._runner.close()

    @property
    def patch_pool(self) -> torch.Tensor:
        if self._patches is None:
            self._patches = shared_tensor.open_("patch_pool").tensor
        return self._patches

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step plan; returns the first tokens of the prompts whose prefill it completed, once the device has
        run the step: the orchestrator hands the encoded groups' patch pages back to flashcodec on this result. The
        step runs on the stream ``self.streams`` picks for ``plan.fewer_sms``."""
        started = time.perf_counter()
        with self.streams.for_step(plan.fewer_sms):
            for req_id in plan.finished:
                self.prompts.pop(req_id, None)
            for key in plan.evict:
                self.encoder_cache.pop(key, None)
            for request in plan.new:
                self._register(request)
            clock = PhaseClock(self.device)
            self._encode(plan.encode)
            clock.mark()
            first_tokens = self._prefill(plan.prefill, self.streams.step_sms(plan.fewer_sms))
            clock.mark()
            phases = None
            if plan.encode or first_tokens:  # waits for the device: the patch pages are read (a sampled token waited)
                phases = clock.phases_ms()
        return StepResult(first_tokens, (time.perf_counter() - started) * 1e3, *(phases or (None, None)))

    def _register(self, request: NewRequest) -> None:
        media = request.media
        # numpy reads a long tuple of ints several times faster than torch.tensor does
        ids = torch.from_numpy(np.fromiter(request.input_ids, np.int64, len(request.input_ids)))
        positions, delta = self.family.prompt_positions(
            self.model.config, ids,
            image_grid_thw=[m.grid_thw for m in media if m.kind == "image"],
            video_grid_thw=[m.grid_thw for m in media if m.kind == "video"],
            second_per_grid_ts=[m.second_per_grid_t for m in media if m.kind == "video"])
        state = PromptState(ids, positions, int(delta), request)
        if request.sampling.structured is not None:
            state.grammar = self._compiles.submit(self.grammars.matcher, request.sampling.structured)
        for start, key in request.cached_embeds:  # kept by an earlier request's encode
            state.visual[start] = self.encoder_cache[key]
        self.prompts[request.req_id] = state

    def _encode(self, works: tuple[EncodeWork, ...]) -> None:
        """The step's groups through the vision tower(s), each group's embeddings kept in its prompt's state."""
        if not works:
            return
        items = []
        for w in works:
            _, h, w_ = self.prompts[w.req_id].request.media[w.item].grid_thw
            rows = read_group(self.patch_pool, list(w.patch_pages), w.num_patches)
            items.append((self.family.pixels_from_patch_rows(self.model.config, rows, (1, h, w_)), (1, h, w_)))
        for work, embeds in zip(works, self.runner.encode_many(items)):
            # a copy: the views encode_many returns would keep the step's whole batch output alive
            rows = embeds.to(self.runner.dtype, copy=True)
            self.prompts[work.req_id].visual[work.token_offset] = rows
            if work.cache_key is not None:  # both read it, neither writes it
                self.encoder_cache[work.cache_key] = rows

    def _prefill(self, works: tuple[PrefillWork, ...], sms: int | None) -> tuple[FirstToken, ...]:
        """The step's prefill chunks, their attention sized to ``sms`` SMs (None: the device's); the first tokens of
        the prompts they end."""
        if not works:
            return ()
        self.runner.backend.sms_limit = sms
        chunks = []
        for w in works:
            state = self.prompts[w.req_id]
            embeds, positions = state.chunk(w.start, w.end, self.runner.embed)
            chunks.append(PrefillChunk(embeds, positions, w.start, list(w.block_table), want_logits=w.is_last,
                                       next_ids=state.next_ids(w.start, w.end),
                                       top=state.sampling.prompt_logprobs or 0))
        logits, scores = self.runner.prefill_scored(chunks)
        for w, score in zip(works, scores):
            if score is not None:
                self.prompts[w.req_id].scores.append(score)
        last = [w for w in works if w.is_last]
        if not last:
            return ()
        states = [self.prompts[w.req_id] for w in last]
        params = [state.sampling for state in states]
        asking = logprobs.start(logits, params)  # the raw logits' (before the bias and the penalties)
        logits = penalize_first_tokens(apply_logit_bias(logits, params), [state.request.input_ids for state in states],
                                       params)
        matchers = [state.grammar and state.grammar.result() for state in states]  # each at its grammar's start
        logits = self.grammars.mask(logits, matchers)
        sampled = sample_tensor(logits, params, [0] * len(last), self.eos_ids)
        tokens = TokenReadback(sampled, logprobs.finish(*asking, sampled) if asking else None)  # both in one wait
        figures = logprobs.rows(asking[0] if asking else None, tokens.figures(), params)
        out = []
        for w, token, token_logprobs, matcher in zip(last, tokens.tolist(), figures, matchers):
            state = self.prompts.pop(w.req_id)
            reason = finish_reason(int(token), 1, state.request.max_tokens, state.sampling, self.eos_ids)
            if matcher is not None:  # an eos that ends a match ends the request here, ignore_eos or not
                reason = accepted(matcher, int(token)) or reason
            out.append(FirstToken(w.req_id, int(token), state.mrope_delta, reason or "", token_logprobs,
                                  state.prompt_logprobs()))
        return tuple(out)
