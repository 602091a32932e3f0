"""Runs a transformers vision-language model on the paged KV pool: vision encoding, chunked prefill, batched decode.

Everything model-specific is the library's: the vision tower, embeddings, decoder layers (norms,
projections, rotary embedding via the rotary module and ``apply_rotary_pos_emb``, MLP), final norm and
``lm_head``. What differs between families (Qwen2.5-VL, InternVL3) is asked of the model's family
(``families.registry.family_for``): which module encodes pixels and how, its speed-ups, the shape of the rotary
positions (M-RoPE's three rows or 1-D RoPE's one). Attention functions are replaced: the language model's layers are
switched to :data:`PAGED_ATTENTION`, registered with transformers' ``AttentionInterface``, which hands q/k/v to the
step's :class:`AttentionBackend` found in the forward context. A ragged batch of sequences runs as one packed
sequence of batch size 1: every op but attention is per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Sequence

import torch
from transformers import AttentionInterface, PreTrainedModel

from backends.runtime.attention.base import AttentionBackend, AttentionMetadata
from backends.runtime.context import ForwardContext, forward_context, get_forward_context
from backends.runtime.language_model.cuda_graphs import DecodeGraphs
from backends.runtime.language_model.kv_cache import head_dim
from backends.runtime.language_model.prefill_graphs import PREFILL_RUNGS, PrefillGraphs
from backends.runtime.language_model.compile import compile_decoder_layers
from backends.runtime.families.base import VisionItem
from backends.runtime.families.registry import family_for
from backends.runtime.language_model.fuse import fuse_projections
from backends.runtime.vision.data_parallel import VisionReplicas
from backends.runtime.vision.tensor_parallel import VisionTensorParallel
from backends.runtime.sampling.logprobs import prompt_figures

if TYPE_CHECKING:
    from backends.runtime.vision.graphs import VisionGraphs

PAGED_ATTENTION = "unifiedserve_paged"


@torch.compiler.disable  # host-side dispatch through the forward context: a graph break when layers are compiled
def _paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, **kwargs: object
                     ) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature: q ``[1, heads, T, d]``, k/v ``[1, kv_heads, T, d]`` in,
    ``[1, T, heads, d]`` out. The causal mask is the backend's business, so ``attention_mask`` is unused."""
    head_dim = query.shape[-1]
    if scaling is not None and abs(scaling - head_dim**-0.5) > 1e-9:
        raise ValueError(f"paged attention supports softmax scale 1/sqrt(head_dim) only, got {scaling}")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("paged attention has no sliding window (the served checkpoints set use_sliding_window=false)")
    context = get_forward_context()
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = context.backend.forward(module.layer_idx, q, k, v, context.kv_cache)
    return out.unsqueeze(0), None


AttentionInterface.register(PAGED_ATTENTION, _paged_attention)


@dataclass(frozen=True)
class PrefillChunk:
    """``n`` prompt tokens of one sequence, stored at KV indices ``num_cached .. num_cached + n - 1``.

    ``embeds``: ``[n, hidden]`` (text embeddings with visual embeddings at the pad positions);
    ``positions``: int64 ``[rows, n]`` rotary positions, ``rows`` the family's ``position_rows`` (3 for
    Qwen2.5-VL's M-RoPE, 1 for InternVL3's 1-D RoPE: its ``prompt_positions``); ``block_table``: the
    sequence's KV pages (at least ``ceil((num_cached + n) / page_size)``); ``want_logits``: return the
    logits of the chunk's last token (the prompt's last chunk); ``next_ids``: int64 ``[m]`` on the CPU (m <= n), the
    prompt tokens that follow the chunk's first m positions, whose log probabilities :meth:`ModelRunner.prefill_scored`
    returns with the ``top`` most likely tokens at each (``SamplingParams.prompt_logprobs``), or None.
    """

    embeds: torch.Tensor
    positions: torch.Tensor
    num_cached: int
    block_table: list[int]
    want_logits: bool
    next_ids: torch.Tensor | None = None
    top: int = 0


@dataclass(frozen=True)
class DecodeSeq:
    """One generated token of one sequence: its id, rotary ``position`` (token index + the prompt's delta; the
    same on all three M-RoPE axes), KV index ``num_cached`` and KV pages ``block_table`` (a list, or an
    int32 numpy array, cheaper to lay out per step: ``AttentionMetadata.build``)."""

    token_id: int
    position: int
    num_cached: int
    block_table: Sequence[int]


class ModelRunner:
    """Executes encode / prefill / decode steps; decides nothing (the orchestrator plans the steps).

    ``model``: a family's transformers model (``families.registry``). Takes over its language-model attention
    (``generate()`` on the same model then raises), fuses its q/k/v and gate/up projections
    (``backends.runtime.language_model.fuse``) and speeds up its vision tower in place with the same output (the
    family's ``prepare_vision``; with ``compile_vision`` on a CUDA model its ``compile_vision``, compiled by the
    first ``encode``).
    ``compile_language_model``: the decoder layers' small ops fused by ``torch.compile`` around the paged
    attention call (``backends.runtime.language_model.compile``; compiled by the first step of each shape).
    ``vision_devices``: more devices, each with a copy of the vision tower, over which :meth:`encode_many`
    spreads a step's items (``backends.runtime.vision.data_parallel``: vision data parallel); ``vision_tp``: more
    devices over which the tower is split instead, one helper process per device
    (``backends.runtime.vision.tensor_parallel``: tensor parallel; ValueError with ``vision_devices`` too, or for a
    family whose tower cannot be split), in towers of ``vision_tp_size`` ranks (default all of them: one tower;
    fewer: hybrid, the towers sharing each step's items). :meth:`close` stops them.
    ``kv_cache`` is the pool ``[layers, 2, pages, page_size, kv_heads, head_dim]`` on the model's device
    in the model's dtype (ValueError otherwise). No method records autograd. ``encode``/``embed`` return
    ordinary tensors, which the caller may write into (visual embeddings into a prompt's embeddings);
    ``prefill``/``decode`` run under ``torch.inference_mode`` and return inference tensors, read-only
    outside that mode.
    """

    def __init__(self, model: PreTrainedModel, kv_cache: torch.Tensor, page_size: int,
                 backend: AttentionBackend, compile_vision: bool = True, compile_language_model: bool = False,
                 vision_devices: Sequence[torch.device] = (), vision_tp: Sequence[torch.device] = (),
                 vision_tp_size: int | None = None) -> None:
        if vision_devices and vision_tp:
            raise ValueError("the vision tower runs data parallel (vision_devices) or tensor parallel (vision_tp), "
                             "not both")
        text = model.config.text_config
        expected = (text.num_hidden_layers, 2, page_size, text.num_key_value_heads, head_dim(model.config))
        got = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
        if kv_cache.dim() != 6 or got != expected:
            raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} does not fit the model: want "
                             f"[{expected[0]}, 2, pages, {page_size}, {expected[3]}, {expected[4]}]")
        device = model.get_output_embeddings().weight.device  # the vision tower may be unbuilt (decode: meta)
        if kv_cache.dtype != model.dtype or kv_cache.device != device:
            raise ValueError(f"kv_cache is {kv_cache.dtype} on {kv_cache.device}, "
                             f"the model {model.dtype} on {device}")
        self.model = model
        self.family = family_for(model.config)
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.backend = backend
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.vision_graphs: VisionGraphs | None = None
        self.device = device
        self.dtype = model.dtype
        self._visual = self.family.vision_encoder(model)
        self._language_model = model.model.language_model
        fuse_projections(self._language_model)
        self._language_model.set_attn_implementation(PAGED_ATTENTION)
        self.family.prepare_vision(self._visual)

        def prepare(tower: torch.nn.Module) -> None:
            if compile_vision and next(tower.parameters()).device.type == "cuda":
                self.family.compile_vision(tower)

        if vision_tp:
            self.family.check_vision_tensor_parallel(model.config, 1 + len(vision_tp),
                                                     vision_tp_size or 1 + len(vision_tp))
        self.vision = (VisionReplicas(self._visual, vision_devices, prepare, self.family.encode_batch)
                       if vision_devices else None)
        self.vision_tp = VisionTensorParallel(self._visual, vision_tp, prepare,
                                              vision_tp_size) if vision_tp else None
        if self.vision_tp is None:  # a split tower is prepared once split
            prepare(self._visual)
        if compile_language_model:
            compile_decoder_layers(self._language_model)

    # no_grad rather than inference_mode: callers write the result into place, which inference tensors forbid.
    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """Merged visual embeddings of one image, one group of a video, or a whole video.

        ``pixel_values`` in the family's layout for ``grid_thw`` (its ``check_pixels``): for Qwen2.5-VL float
        ``[t*h*w, C*temporal_patch*patch*patch]`` (1176) patch rows in the processor's order, ``t`` temporal
        patches; for InternVL3 float ``[t, 3, h*14, w*14]`` tiles. Returns ``[t*h*w / 4, hidden]`` in the model
        dtype. Both towers attend within a temporal patch or a tile, so encoding a video group by group gives the
        same result. Raises ValueError when ``pixel_values`` do not fit ``grid_thw``.
        """
        return self.encode_many([(pixel_values, grid_thw)])[0]

    @torch.no_grad()
    def encode_many(self, items: Sequence[VisionItem]) -> list[torch.Tensor]:
        """:meth:`encode` of each ``(pixel_values, grid_thw)``, in order, on the model's device; spread over the
        vision towers of ``vision_devices`` when there are any; an item whose grid has a CUDA graph replays it
        (:meth:`enable_vision_graphs`). Raises ValueError as :meth:`encode` does."""
        for pixel_values, grid_thw in items:
            self.family.check_pixels(self.model.config, pixel_values, grid_thw)
        if self.vision_tp is not None:
            return self.vision_tp.encode_many(items)
        if self.vision is not None:
            return self.vision.encode_many(items, self.device)
        if self.vision_graphs is not None:
            return self.vision_graphs.encode_many(items, partial(self.family.encode_batch, self._visual))
        return self.family.encode_batch(self._visual, items)

    def close(self) -> None:
        """Stop the vision helpers (threads of the data-parallel towers, processes of the split one)."""
        for vision in (self.vision, self.vision_tp):
            if vision is not None:
                vision.close()

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: int64 ``[n]`` -> ``[n, hidden]`` in the model dtype, on the model device."""
        return self._language_model.embed_tokens(input_ids.to(self.device))

    def prefill(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """Run prompt chunks of several sequences as one ragged batch, writing their KV.

        Returns float32 ``[number of chunks with want_logits, vocab]``, in chunk order. One chunk of at most
        ``prefill_graphs.max_rows`` tokens replays a captured CUDA graph when :meth:`enable_prefill_graphs` was
        called; other steps run eagerly. Raises ValueError for an empty list, chunks whose shapes disagree, or a
        chunk with ``next_ids`` (:meth:`prefill_scored` returns their log probabilities).
        """
        if any(chunk.next_ids is not None for chunk in chunks):
            raise ValueError("a chunk with next_ids asks for its log probabilities: run it with prefill_scored")
        return self.prefill_scored(chunks)[0]

    @torch.inference_mode()
    def prefill_scored(self, chunks: list[PrefillChunk]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """:meth:`prefill`'s logits, and per chunk its prompt log probabilities where it has ``next_ids``
        (``backends.runtime.sampling.logprobs.prompt_figures``: float32 ``[m, 2 + 2 * top]`` on the device), else
        None. A chunk with ``next_ids`` runs eagerly (its every position's hidden state is read). Raises ValueError as
        :meth:`prefill`."""
        if not chunks:
            raise ValueError("prefill needs at least one chunk")
        for chunk in chunks:
            n = chunk.embeds.shape[0]
            if chunk.positions.shape != (self.family.position_rows, n):
                raise ValueError(f"chunk positions {tuple(chunk.positions.shape)} do not match {n} tokens")
            if chunk.next_ids is not None and chunk.next_ids.shape[0] > n:
                raise ValueError(f"{chunk.next_ids.shape[0]} next ids for a chunk of {n} tokens")
        graphs = self.prefill_graphs
        if graphs is not None and len(chunks) == 1 and chunks[0].embeds.shape[0] <= graphs.max_rows \
                and chunks[0].next_ids is None:
            return graphs.run(chunks[0]), [None]
        metadata = AttentionMetadata.build(
            [c.embeds.shape[0] for c in chunks], [c.num_cached for c in chunks], [c.block_table for c in chunks],
            self.page_size, self.device)
        embeds = torch.cat([c.embeds for c in chunks]).to(self.device, self.dtype)
        positions = torch.cat([c.positions for c in chunks], dim=1).to(self.device)
        hidden = self._forward(embeds, positions, metadata)
        last = metadata.cu_seqlens_q[1:].to(self.device, torch.long) - 1
        wanted = torch.tensor([c.want_logits for c in chunks], device=self.device)
        scores, start = [], 0
        for c in chunks:
            n = c.embeds.shape[0]
            scores.append(None if c.next_ids is None else
                          prompt_figures(self.model.lm_head, hidden[start:start + n], c.next_ids, c.top))
            start += n
        return self.model.lm_head(hidden[last[wanted]]).float(), scores

    @torch.inference_mode()
    def decode(self, seqs: list[DecodeSeq], token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each sequence; returns float32 logits ``[len(seqs), vocab]``.

        ``token_ids``: int64 ``[len(seqs)]`` on the model's device, used instead of ``seqs``' token ids (the
        last step's samples, which the host has not read: ``backends.runtime.sampling.token_readback``). Runs a captured
        CUDA graph when :meth:`enable_cuda_graphs` was called and one fits the batch. Raises ValueError for an
        empty list or ``token_ids`` of another length.
        """
        if not seqs:
            raise ValueError("decode needs at least one sequence")
        if token_ids is not None and tuple(token_ids.shape) != (len(seqs),):
            raise ValueError(f"token_ids {tuple(token_ids.shape)} for {len(seqs)} sequences")
        if self.graphs is not None and len(seqs) <= self.graphs.max_batch:
            return self.graphs.run(seqs, token_ids).clone()  # the graph's buffer is overwritten by its next replay
        if token_ids is None:
            token_ids = torch.tensor([s.token_id for s in seqs], dtype=torch.long, device=self.device)
        metadata = AttentionMetadata.build(
            [1] * len(seqs), [s.num_cached for s in seqs], [s.block_table for s in seqs], self.page_size, self.device)
        self.backend.plan(metadata)
        positions = torch.tensor([s.position for s in seqs], dtype=torch.long, device=self.device)
        return self.decode_logits(token_ids, positions, self.backend, metadata)

    def prepare_decode(self, seqs: list[DecodeSeq]) -> None:
        """Plan the next :meth:`decode` for ``seqs`` ahead, while the GPU still runs this step (their token ids
        are not read: ``DecodeGraphs.prepare``). Does nothing without CUDA graphs or for a batch too large for
        them (those steps are planned when they run)."""
        if self.graphs is not None and 0 < len(seqs) <= self.graphs.max_batch:
            self.graphs.prepare(seqs)

    def enable_cuda_graphs(self, batch_sizes: Sequence[int]) -> None:
        """Capture decode steps for these batch sizes (``backends.runtime.language_model.cuda_graphs``); larger batches
        run eagerly. Needs the flashinfer backend on a CUDA device (ValueError otherwise)."""
        self.graphs = DecodeGraphs(self, batch_sizes)

    def enable_prefill_graphs(self, rungs: Sequence[int] = PREFILL_RUNGS) -> None:
        """Capture prefill chunks of one sequence for these token counts
        (``backends.runtime.language_model.prefill_graphs``); larger chunks and steps of several sequences run
        eagerly. Needs the flashinfer backend on a CUDA device (ValueError otherwise)."""
        self.prefill_graphs = PrefillGraphs(self, rungs)

    def enable_vision_graphs(self) -> None:
        """Replay CUDA graphs of the vision tower per item grid (the family's ``vision_graphs``, e.g.
        ``backends.runtime.vision.graphs``: captured as grids recur). Raises ValueError where the tower is spread or
        split over several GPUs, is not on a CUDA device, or its family has no such graphs."""
        if self.vision is not None or self.vision_tp is not None:
            raise ValueError("vision graphs need one vision tower, on the model's GPU (no vision_devices, vision_tp)")
        self.vision_graphs = self.family.vision_graphs(self._visual)

    def decode_logits(self, token_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                      metadata: AttentionMetadata) -> torch.Tensor:
        """The body of a decode step after ``backend.plan(metadata)``: no host sync, so a CUDA graph can
        capture it. ``token_ids``/``positions``: int64 or int32 (a graph's inputs) ``[b]`` on the device (the
        position is the same on every row of the family's positions). Returns float32 logits ``[b, vocab]``."""
        embeds = self._language_model.embed_tokens(token_ids)
        hidden = self.run_layers(embeds, positions.expand(self.family.position_rows, -1), backend, metadata)
        return self.model.lm_head(hidden).float()

    def _forward(self, embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Plan the step, then run the layers (see :meth:`run_layers`)."""
        self.backend.plan(metadata)
        return self.run_layers(embeds, positions, self.backend, metadata)

    def run_layers(self, embeds: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                   metadata: AttentionMetadata) -> torch.Tensor:
        """Decoder layers and final norm after ``backend.plan(metadata)``: packed embeddings ``[T, hidden]`` (model
        dtype) and int positions ``[position_rows, T]`` on the device -> ``[T, hidden]``. No host sync, so a CUDA graph
        can capture it."""
        hidden = embeds.unsqueeze(0)
        position_embeddings = self._language_model.rotary_emb(hidden, self.family.rotary_position_ids(positions))
        with forward_context(ForwardContext(backend, self.kv_cache, metadata)):
            for layer in self._language_model.layers:
                hidden = layer(hidden, attention_mask=None, position_embeddings=position_embeddings)
        return self._language_model.norm(hidden)[0]
