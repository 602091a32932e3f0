"""Speed of the Qwen2.5-VL vision tower with the same output: an aligned MLP width, compiled small ops.

Profiled on the H200, the 7B tower (with :mod:`backends.runtime.vision.attention`) has two costs that no
attention kernel removes (bench/RESULTS.md, "vision tower, compiled", for what removing them gives):

* Matmuls at the MLP width 3420: a bf16 row of 3420 elements is 6,840 bytes, not a multiple of 16, and
  cuBLAS then falls back to slow kernels (214-253 TFLOP/s against 737-742 at 3424). :func:`pad_vision_mlp`
  zero-pads the width to a multiple of 8 elements, which leaves the output unchanged.
* About 40% of the time in transformers' small float32 ops (RMSNorm, vision rotary embedding, casts, the
  bias/residual adds), each a separate kernel. :func:`compile_vision_blocks` has ``torch.compile`` fuse them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel


def _check_tower(visual: nn.Module) -> None:
    if not isinstance(visual, Qwen2_5_VisionTransformerPretrainedModel):
        raise TypeError(f"want a Qwen2.5-VL vision tower, got {type(visual).__name__}")


def _pad_rows(linear: nn.Linear, rows: int) -> None:
    """Append ``rows`` zero output features (weight rows and bias entries)."""
    linear.weight = nn.Parameter(F.pad(linear.weight.detach(), (0, 0, 0, rows)),
                                 requires_grad=linear.weight.requires_grad)
    if linear.bias is not None:
        linear.bias = nn.Parameter(F.pad(linear.bias.detach(), (0, rows)), requires_grad=linear.bias.requires_grad)
    linear.out_features += rows


def _pad_columns(linear: nn.Linear, columns: int) -> None:
    """Append ``columns`` zero input features (weight columns)."""
    linear.weight = nn.Parameter(F.pad(linear.weight.detach(), (0, columns)), requires_grad=linear.weight.requires_grad)
    linear.in_features += columns


@torch.no_grad()
def pad_vision_mlp(visual: nn.Module, multiple: int = 8) -> int:
    """Zero-pad every vision block's gated MLP to an intermediate width that is a multiple of ``multiple``.

    ``visual``: the tower (``model.model.visual``), any dtype and device, dummy or loaded weights. Each
    block's ``Qwen2_5_VLMLP`` computes ``down_proj(act(gate_proj(x)) * up_proj(x))``; the new
    ``gate_proj``/``up_proj`` output rows (weight and bias) and ``down_proj`` input columns are zero, so a
    new feature is ``act(0) * 0 = 0`` and its down-projection column adds 0: the output is unchanged. The
    tower's config keeps the real ``intermediate_size`` (FLOP counts use it); each MLP's
    ``intermediate_size`` attribute becomes the padded width. ``multiple`` 8 makes bf16/fp16 rows
    16-byte aligned, which cuBLAS's fast kernels want. A no-op when the width already is a multiple.
    Returns the width now in use. Raises TypeError for another module, ValueError for ``multiple < 1``.
    """
    _check_tower(visual)
    if multiple < 1:
        raise ValueError(f"multiple must be at least 1, got {multiple}")
    width = visual.config.intermediate_size
    for block in visual.blocks:
        mlp = block.mlp
        width = mlp.gate_proj.out_features
        extra = -width % multiple
        if extra:
            _pad_rows(mlp.gate_proj, extra)
            _pad_rows(mlp.up_proj, extra)
            _pad_columns(mlp.down_proj, extra)
            width += extra
            mlp.intermediate_size = width
    return width


def compile_vision_blocks(visual: nn.Module, dynamic: bool = True) -> None:
    """Compile each vision block (``Qwen2_5_VLVisionBlock``) and the patch merger with ``torch.compile``.

    A block is norm1, qkv projection, rotary embedding (``apply_rotary_pos_emb_vision``), attention, output
    projection, residual add, norm2, MLP, residual add: everything but the attention fuses into two graphs
    around it. The attention function (:func:`~backends.runtime.vision.attention.varlen_vision_attention`,
    with a host sync and shapes that depend on ``cu_seqlens``) is excluded from compilation, so it is a
    graph break and runs eagerly. All blocks share one class and, with dynamo's inlined module
    parameters, one set of graphs. ``dynamic=True`` makes the token count symbolic, so a new ``grid_thw``
    does not recompile. Lazy: the first forward compiles (tens of seconds for the 7B tower on a GPU).
    Meant for CUDA; a CPU compile needs a C++ compiler. Raises TypeError for another module.
    """
    _check_tower(visual)
    for block in visual.blocks:
        block.compile(dynamic=dynamic)
    visual.merger.compile(dynamic=dynamic)
