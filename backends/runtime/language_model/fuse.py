"""The language model's q/k/v and gate/up projections, each set concatenated into one matrix product.

transformers writes a Qwen2-style decoder layer (Qwen2.5-VL's text model; Qwen2, InternVL3's language model) with
five input projections: ``q_proj``, ``k_proj`` and
``v_proj`` (with biases) and the MLP's ``gate_proj`` and ``up_proj``, each its own product over the same
input. A decode step at small batch streams the weights once, so each product is a matrix-vector
product bound by memory, and small ones lose bandwidth to their start-up and cuBLAS's split-K reduction
kernels (on the H200, two products stream the weights about 18% faster than five: bench/RESULTS.md, "decode
step, breakdown"). vLLM and SGLang fuse them the same way
(``QKVParallelLinear``, ``MergedColumnParallelLinear``).

:func:`fuse_projections` replaces, in each layer, the three attention projections by one ``qkv_proj``
(``[q; k; v]`` rows, biases likewise) and gate/up by one ``gate_up_proj`` (``[gate; up]``), and swaps the
modules' classes for subclasses whose ``forward`` splits the product's output; everything else (the rotary
embedding via transformers' ``apply_rotary_pos_emb``, the same function in both models, the attention function
chosen by ``config._attn_implementation``, ``o_proj``, the activation, ``down_proj``) is the library's. The same
weights, so the same function; one copy of them (the old tensors are released layer by layer).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen2 import modeling_qwen2 as qwen2
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen

# transformers' attention and MLP classes whose forward the fused ones reproduce: q/k/v with biases, rotary
# embedding on the given cos/sin, the configured attention function, o_proj; down(act(gate) * up).
ATTENTION_CLASSES = (qwen.Qwen2_5_VLAttention, qwen2.Qwen2Attention)
MLP_CLASSES = (qwen.Qwen2MLP, qwen2.Qwen2MLP)


class FusedQKVAttention(nn.Module):
    """Mixed into one of :data:`ATTENTION_CLASSES` (:func:`fuse_projections` makes the subclass): ``qkv_proj`` in
    place of ``q_proj``/``k_proj``/``v_proj``. Same arguments and outputs as the library's ``forward``, except that
    it takes no KV cache object (the paged attention function keeps the KV): ValueError when given one."""

    qkv_sizes: tuple[int, int, int]

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: object = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if past_key_values is not None:
            raise ValueError("fused attention keeps no transformers KV cache (the paged attention holds the KV)")
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)  # [batch, tokens, heads, head_dim]
        q, k, v = (t.view(shape).transpose(1, 2) for t in self.qkv_proj(hidden_states).split(self.qkv_sizes, -1))
        cos, sin = position_embeddings
        q, k = qwen.apply_rotary_pos_emb(q, k, cos, sin)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, qwen.eager_attention_forward)
        out, weights = attend(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                              scaling=self.scaling, sliding_window=self.sliding_window, position_ids=position_ids,
                              **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights


class FusedGateUpMLP(nn.Module):
    """Mixed into one of :data:`MLP_CLASSES`: ``gate_up_proj`` in place of ``gate_proj``/``up_proj``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _concat(parts: list[nn.Linear]) -> nn.Linear:
    """One linear layer whose output is the ``parts``' outputs side by side; the parts' weights are dropped."""
    weight = parts[0].weight
    fused = nn.Linear(weight.shape[1], sum(p.out_features for p in parts), bias=parts[0].bias is not None,
                      device="meta", dtype=weight.dtype)
    grad = weight.requires_grad
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=grad)
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=grad)
    return fused


_fused_classes: dict[tuple[type, type], type] = {}


def _fused_class(mixin: type, library_class: type) -> type:
    """``mixin``'s forward over ``library_class`` (its ``__init__`` and attributes), one class per pair."""
    key = (mixin, library_class)
    if key not in _fused_classes:
        _fused_classes[key] = type(f"{mixin.__name__}_{library_class.__name__}", key, {})
    return _fused_classes[key]


def fuse_projections(language_model: nn.Module) -> None:
    """Fuse every decoder layer of ``language_model`` (``Qwen2_5_VLTextModel``, ``Qwen2Model``) in place, as the module
    docstring says; a layer already fused is left alone. Raises TypeError for layers that are not transformers'
    Qwen2.5-VL or Qwen2 decoder layers."""
    for layer in language_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, ATTENTION_CLASSES) or not isinstance(mlp, MLP_CLASSES):
            raise TypeError(f"expected transformers' Qwen2 or Qwen2.5-VL decoder layers, got {type(attn).__name__}, "
                            f"{type(mlp).__name__}")
        if not isinstance(attn, FusedQKVAttention):
            attn.qkv_sizes = (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)
            attn.qkv_proj = _concat([attn.q_proj, attn.k_proj, attn.v_proj])
            del attn.q_proj, attn.k_proj, attn.v_proj
            attn.__class__ = _fused_class(FusedQKVAttention, type(attn))
        if not isinstance(mlp, FusedGateUpMLP):
            mlp.gate_up_proj = _concat([mlp.gate_proj, mlp.up_proj])
            del mlp.gate_proj, mlp.up_proj
            mlp.__class__ = _fused_class(FusedGateUpMLP, type(mlp))
