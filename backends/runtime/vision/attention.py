"""Variable-length attention for the Qwen2.5-VL vision tower: all windows (or frames) of a layer at once.

transformers' ``Qwen2_5_VLVisionAttention.forward`` runs its attention function once per segment
(window or frame) unless ``is_flash_attention_requested(config)``, which is true when the implementation's
name contains "flash"; then it calls the function once for the whole packed sequence with
``cu_seq_lens_q``/``cu_seq_lens_k``. That is why :data:`VARLEN_VISION_ATTENTION` carries "flash" in its
name: the name makes transformers hand us the segment boundaries. The function itself is plain torch:
segments are grouped by length (in a video almost every window has the same length, and every frame does)
and each group runs as one ``scaled_dot_product_attention`` over a ``[segments, heads, L, head_dim]``
batch, for which PyTorch picks its flash / memory-efficient kernel on the GPU. Any dtype, CPU or GPU, any
head_dim (the 7B tower has 80).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AttentionInterface
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

VARLEN_VISION_ATTENTION = "unifiedserve_flash_varlen"


@dataclass(frozen=True)
class _SegmentPlan:
    """How the tokens of one ``cu_seqlens`` are batched.

    ``groups``: ``(length, count)`` per distinct segment length, in the order of ``order``. ``order``: int64
    ``[T]`` on the tokens' device, the token indices grouped by segment length (segments of one length keep
    their order), or None when the tokens already are in that order (one length). ``inverse``: int64 ``[T]``,
    the position in ``order`` of each token (None with ``order``).
    """

    groups: tuple[tuple[int, int], ...]
    order: torch.Tensor | None
    inverse: torch.Tensor | None


# One plan per cu_seqlens tensor: the vision tower passes the same tensor to all its window layers (and
# another to its full-attention layers), so the host sync and the index build happen twice per forward,
# not once per layer. Entries vanish with their tensor; ``_version`` catches an in-place change.
_plans: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _plan(cu_seqlens: torch.Tensor, num_tokens: int, device: torch.device) -> _SegmentPlan:
    # Inference tensors have no version counter; they cannot change outside inference mode.
    version = None if cu_seqlens.is_inference() else cu_seqlens._version
    cached = _plans.get(cu_seqlens)
    if cached is not None and cached[:2] == (version, device):
        return cached[2]
    bounds = cu_seqlens.tolist()  # the one host sync (transformers itself calls .tolist() on it)
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != num_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to the token count {num_tokens}, "
                         f"got {bounds[:3]}...{bounds[-2:]}")
    starts_by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end < start:
            raise ValueError(f"cu_seqlens must not decrease, got {start} then {end}")
        if end > start:  # a zero-length segment holds no token
            starts_by_length.setdefault(end - start, []).append(start)
    groups = tuple((length, len(starts)) for length, starts in starts_by_length.items())
    if len(groups) == 1:
        plan = _SegmentPlan(groups, None, None)
    else:
        order = torch.cat([(torch.tensor(starts)[:, None] + torch.arange(length)).flatten()
                           for length, starts in starts_by_length.items()])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(num_tokens)
        plan = _SegmentPlan(groups, order.to(device, non_blocking=True), inverse.to(device, non_blocking=True))
    _plans[cu_seqlens] = (version, device, plan)
    return plan


# Under torch.compile (backends.runtime.vision.speed compiles the blocks) this is a graph break: the plan's host
# sync and the per-length batches have shapes that depend on cu_seqlens' values, which a graph cannot hold.
@torch.compiler.disable
def varlen_vision_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                            is_causal: bool = False, **kwargs: object) -> tuple[torch.Tensor, None]:
    """Non-causal attention within each segment of a packed sequence (transformers' attention-function signature).

    ``query``/``key``/``value``: ``[1, heads, T, head_dim]``, one dtype, one device. ``cu_seq_lens_q``: int
    ``[segments + 1]`` cumulative segment boundaries from 0 to T (None: one segment); ``cu_seq_lens_k`` must
    be the same (self-attention). ``scaling``: softmax scale (None: ``head_dim ** -0.5``). Returns
    ``([1, T, heads, head_dim], None)``: a token attends to the tokens of its own segment only, as
    transformers' per-segment ``sdpa`` path computes. ``max_length_q/k`` and other kwargs are ignored.
    Raises ValueError for a mask, causal attention, key heads unlike query heads, unequal q/k boundaries, or
    boundaries that do not cover the T tokens.
    """
    if attention_mask is not None or is_causal:
        raise ValueError("vision varlen attention is non-causal and takes no attention_mask")
    if query.shape[0] != 1 or key.shape != query.shape or value.shape != query.shape:
        raise ValueError(f"want q/k/v of one shape [1, heads, T, head_dim], got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q and (
            cu_seq_lens_q is None or not torch.equal(cu_seq_lens_k, cu_seq_lens_q)):
        raise ValueError("vision varlen attention is self-attention: cu_seq_lens_k must equal cu_seq_lens_q")
    _, heads, num_tokens, head_dim = query.shape
    # Token-major [T, heads, d]: gathered segments then come out as [n, L, heads, d], whose transpose is the
    # layout PyTorch's flash kernel reads without a copy.
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if cu_seq_lens_q is None:
        plan = _SegmentPlan(((num_tokens, 1),), None, None)
    else:
        plan = _plan(cu_seq_lens_q, num_tokens, query.device)
    if plan.order is not None:
        q, k, v = (t.index_select(0, plan.order) for t in (q, k, v))
    outputs, offset = [], 0
    for length, count in plan.groups:
        size = length * count
        batch = [t[offset:offset + size].reshape(count, length, heads, head_dim).transpose(1, 2) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*batch, dropout_p=dropout, is_causal=False, scale=scaling)
        outputs.append(out.transpose(1, 2).reshape(size, heads, head_dim))
        offset += size
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    if plan.inverse is not None:
        out = out.index_select(0, plan.inverse)
    return out.unsqueeze(0), None


AttentionInterface.register(VARLEN_VISION_ATTENTION, varlen_vision_attention)


def use_varlen_vision_attention(visual: torch.nn.Module) -> None:
    """Switch a Qwen2.5-VL vision tower (``model.model.visual``) to :data:`VARLEN_VISION_ATTENTION`.

    Sets the tower's own config (``Qwen2_5_VLVisionConfig``, shared by all its blocks), so the language model
    keeps its implementation. Not ``visual.set_attn_implementation``: its check takes any name containing
    "flash" for a flash-attn kernel to be loaded from the Hub and raises ValueError. The config's
    ``_attn_implementation`` is what that method sets once its checks pass. Raises TypeError for another module.
    """
    if not isinstance(visual, Qwen2_5_VisionTransformerPretrainedModel):
        raise TypeError(f"want a Qwen2.5-VL vision tower, got {type(visual).__name__}")
    visual.config._attn_implementation = VARLEN_VISION_ATTENTION
