"""Fusing the language model's small per-layer ops with ``torch.compile`` (same output, fewer kernels).

transformers writes a Qwen2.5-VL decoder layer as many small ops: RMSNorm in float32 (cast, square, mean,
rsqrt, scale, cast back), M-RoPE (split, cat, rotate-half), SiLU-and-multiply, residual adds. A decode
step at small batch is bound by launching these (about 30 kernels per layer) rather than by the weight
reads; compiling each layer lets inductor fuse them. The paged attention call in the middle is excluded
(``torch.compiler.disable`` on it in ``model_runner``): it dispatches on the host through the forward
context, so dynamo compiles the parts before and after it. ``dynamic=True`` keeps one compiled graph for
all token counts (the batch-size-1 specialisation aside), so CUDA-graph capture at each batch size of the
ladder finds compiled code after its warm-up runs.
"""
from __future__ import annotations

from torch import nn


def compile_decoder_layers(language_model: nn.Module, dynamic: bool = True) -> None:
    """``torch.compile`` each decoder layer of ``language_model`` (``Qwen2_5_VLTextModel``) and its final norm,
    in place and lazily (the first call of each shape compiles). Raises TypeError when the module has no
    ``layers``/``norm`` (not a transformers decoder stack)."""
    if not isinstance(getattr(language_model, "layers", None), nn.ModuleList) or not hasattr(language_model, "norm"):
        raise TypeError("expected a transformers decoder stack with .layers and .norm, "
                        f"got {type(language_model).__name__}")
    for layer in language_model.layers:
        layer.compile(dynamic=dynamic)
    language_model.norm.compile(dynamic=dynamic)
