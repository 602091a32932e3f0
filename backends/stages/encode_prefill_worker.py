"""The encode+prefill stage: executes one scheduler step plan from the orchestrator.

A plan (JSON, built by orchestrator/stages.py) has four parts, run in this order:
* ``new``: prompts seen for the first time: token ids, media grids; the worker embeds the text and
  computes M-RoPE positions once (transformers' ``get_rope_index``) and keeps them per request;
* ``encode``: whole temporal-patch groups: patches are read from the shared patch pool pages, run
  through the vision encoder, and their embeddings placed at the group's visual-token rows;
* ``prefill``: prompt chunks ``[start, end)`` written into the shared KV pool (block tables given);
  the chunk that ends a prompt yields its first sampled token;
* ``release``: requests that ended (finished, failed or cancelled) whose state is dropped.
The runtime decides nothing: what runs in a step is the orchestrator's scheduler's call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.ipc import shared_tensor, shared_weights
from backends.runtime.attention import make_backend
from backends.runtime.language_model.fuse import fuse_projections
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import ModelRunner, PrefillChunk
from backends.runtime.language_model.mrope import mrope_positions
from backends.runtime.sampling.sampler import SamplingParams, sample, warm_up
from backends.runtime.tokenizer import eos_token_ids
from backends.runtime.vision.tensor_parallel import check_towers
from flashcodec.patch_pool import read_group


@dataclass
class PromptState:
    """A prompt being prefilled: ``embeds`` [L, hidden] (visual rows filled as groups are encoded),
    ``positions`` [3, L] int64 M-RoPE positions, ``mrope_delta`` for the decode positions."""

    embeds: torch.Tensor
    positions: torch.Tensor
    mrope_delta: int
    sampling: SamplingParams


class EncodePrefillWorker:
    """Maps the KV pool (owner: decode) and the patch pool (owner: flashcodec) lazily, on first use.

    ``attention_backend``: the prefill attention (see ``attention.make_backend``); ``vision_devices``: more
    devices for the vision tower: with ``vision_parallel`` "data" each holds a copy and each step's encode work
    is spread over them, with "tensor" the tower is split over them (``ModelRunner``'s ``vision_tp``), in towers
    of ``vision_tp_size`` GPUs each (None: all; fewer: hybrid, data parallel over the towers);
    ``kv_pool``: the name of the decode stage's pool to write (``backends.triton.replicas``); ``lm_weights``: the name
    of the decode stage's shared language-model weights, used in place of this stage's own copy when published
    (``backends.ipc.shared_weights``)."""

    def __init__(self, spec: ModelSpec, device: torch.device, attention_backend: str = "auto",
                 vision_devices: list[torch.device] | tuple = (), kv_pool: str = "kv_pool",
                 lm_weights: str = "lm_weights", vision_parallel: str = "data", vision_tp_size: int | None = None):
        if vision_parallel not in ("data", "tensor"):
            raise ValueError(f"vision_parallel must be data or tensor, got {vision_parallel!r}")
        if vision_tp_size is not None and vision_parallel != "tensor":
            raise ValueError(f"vision_tp_size {vision_tp_size} needs vision_parallel=tensor")
        self.vision_parallel, self.vision_tp_size = vision_parallel, vision_tp_size
        self.model, tokenizer = load_model(spec)
        fuse_projections(self.model.model.language_model)  # as ModelRunner would; decode shares fused weights
        if vision_tp_size is not None:  # at load, not at the first step, where the split tower is made
            try:
                check_towers(1 + len(vision_devices), vision_tp_size, self.model.config.vision_config.num_heads)
            except ValueError as exc:
                raise ValueError(f"vision_tp_size {vision_tp_size}: {exc}") from None
        self.device = device
        warm_up(device, self.model.lm_head.out_features)
        self.attention_backend = attention_backend
        self.vision_devices = list(vision_devices)
        self.kv_pool, self.lm_weights = kv_pool, lm_weights
        self._weights = None  # the shared weights once adopted (kept referenced)
        # language-model weight bytes by copy (shared_weights.held_bytes), updated when the first step maps decode's
        self.weights_held = shared_weights.held_bytes(self.model, None)
        self.eos_ids = eos_token_ids(tokenizer)
        self.prompts: dict[str, PromptState] = {}
        self._runner: ModelRunner | None = None
        self._patches: torch.Tensor | None = None

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            kv = shared_tensor.open_(self.kv_pool).tensor  # [layers, 2, pages, page_size, kv_heads, head_dim]
            self._weights = shared_weights.adopt(self.model, self.lm_weights, self.device)  # before any forward
            self.weights_held = shared_weights.held_bytes(self.model, self._weights)
            backend = make_backend(self.attention_backend, self.model.config, kv.shape[3], self.model.dtype,
                                   self.device)
            split = self.vision_parallel == "tensor"
            self._runner = ModelRunner(self.model, kv, kv.shape[3], backend,
                                       vision_devices=() if split else self.vision_devices,
                                       vision_tp=self.vision_devices if split else (),
                                       vision_tp_size=self.vision_tp_size)
        return self._runner

    def shutdown(self) -> None:
        """Stop the vision helpers, if the runner was made."""
        if self._runner is not None:
            self._runner.close()

    @property
    def patch_pool(self) -> torch.Tensor:
        if self._patches is None:
            self._patches = shared_tensor.open_("patch_pool").tensor
        return self._patches

    def execute(self, plan: dict) -> dict:
        """Run one step plan; returns ``{"first_tokens": [{"req", "token", "mrope_delta"}]}``."""
        for item in plan.get("new", []):
            self._register(item)
        self._encode(plan.get("encode", []))
        first_tokens = self._prefill(plan.get("prefill", []))
        for req_id in plan.get("release", []):
            self.prompts.pop(req_id, None)
        return {"first_tokens": first_tokens}

    def _register(self, item: dict) -> None:
        ids = item["input_ids"]
        media = item["media"]
        positions, delta = mrope_positions(
            self.model.config, ids,
            image_grid_thw=[tuple(m["grid_thw"]) for m in media if m["kind"] == "image"],
            video_grid_thw=[tuple(m["grid_thw"]) for m in media if m["kind"] == "video"],
            second_per_grid_ts=[m["second_per_grid_t"] for m in media if m["kind"] == "video"])
        embeds = self.runner.embed(torch.tensor(ids, dtype=torch.long, device=self.device))
        self.prompts[item["req"]] = PromptState(embeds, positions.to(self.device), int(delta),
                                                SamplingParams(**item["sampling"]))

    def _encode(self, works: list[dict]) -> None:
        """The step's groups through the vision tower(s), each group's embeddings into its prompt's rows."""
        if not works:
            return
        items = [(read_group(self.patch_pool, w["pages"], w["num_patches"]), tuple(w["grid_thw"])) for w in works]
        for work, embeds in zip(works, self.runner.encode_many(items)):
            state, start = self.prompts[work["req"]], work["token_offset"]
            state.embeds[start:start + embeds.shape[0]] = embeds.to(state.embeds.dtype)

    def _prefill(self, works: list[dict]) -> list[dict]:
        if not works:
            return []
        chunks = []
        for w in works:
            state = self.prompts[w["req"]]
            start, end = w["start"], w["end"]
            chunks.append(PrefillChunk(state.embeds[start:end], state.positions[:, start:end], start,
                                       w["block_table"], want_logits=w["is_last"]))
        logits = self.runner.prefill(chunks)
        last = [w for w in works if w["is_last"]]
        if not last:
            return []
        tokens = sample(logits, [self.prompts[w["req"]].sampling for w in last], [0] * len(last), self.eos_ids)
        out = []
        for w, token in zip(last, tokens):
            out.append({"req": w["req"], "token": int(token), "mrope_delta": self.prompts[w["req"]].mrope_delta})
            del self.prompts[w["req"]]  # prefill done: the embeddings are no longer needed
        return out
