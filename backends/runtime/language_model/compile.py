"""Fusing the language model's small per-layer ops with ``torch.compile`` (same output, fewer kernels).

transformers writes a Qwen2.5-VL decoder layer as many small ops: RMSNorm in float32 (cast, square, mean,
rsqrt, scale, cast back), M-RoPE (split, cat, rotate-half), SiLU-and-multiply, residual adds. A decode
step at small batch is bound by launching these (about 30 kernels per layer) rather than by the weight
reads; compiling each layer lets inductor fuse them. The paged attention call in the middle is excluded
(``torch.compiler.disable`` on it in ``model_runner``): it dispatches on the host through the forward
context, so dynamo compiles the parts before and after it. ``dynamic=True`` keeps one compiled graph for
all token counts (the batch-size-1 specialisation aside), so CUDA-graph capture at each batch size of the
ladder finds compiled code after its warm-up runs.

A compile that fails (no C compiler, an inductor error) would fail every later forward, each trying again:
:func:`warm_up_compiled` compiles at a chosen moment and, on failure, puts the layers back to eager.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from backends.runtime.language_model.kv_cache import scratch_page
from backends.runtime.language_model.prefill_graphs import capture_layout

if TYPE_CHECKING:
    from backends.runtime.model_runner import ModelRunner

# The token count of the first compiled forward: torch's duck sizing ties the graph's token dimension to any other
# dimension of the same size at the first compile (head_dim 128, the head counts, M-RoPE's 3 rows), and every other
# count would then compile again. 509 is prime and none of the served models' sizes.
WARM_UP_TOKENS = 509


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


def uncompile_decoder_layers(language_model: nn.Module) -> None:
    """Undo :func:`compile_decoder_layers`: the layers and the final norm run eagerly again (``nn.Module.compile``
    keeps its compiled call in ``_compiled_call_impl``; torch has no public undo)."""
    for module in (*language_model.layers, language_model.norm):
        module._compiled_call_impl = None


def warm_up_compiled(runner: ModelRunner, token_counts: Sequence[int] = (WARM_UP_TOKENS,)) -> str | None:
    """Compile ``runner``'s decoder layers now, one eager prefill forward of each of ``token_counts`` tokens (zero
    embeddings, position 0) whose keys and values go to the pool's scratch page only. None when they ran; else the
    layers are put back to eager (:func:`uncompile_decoder_layers`) and the failure is returned as a sentence."""
    language_model = runner.model.model.language_model
    scratch = scratch_page(runner.kv_cache.shape[2])
    hidden = runner.model.config.get_text_config().hidden_size
    try:
        with torch.inference_mode():
            for n in token_counts:
                metadata = capture_layout(n, scratch, runner.page_size, runner.device)
                runner.backend.plan(metadata)
                embeds = torch.zeros(n, hidden, dtype=runner.dtype, device=runner.device)
                positions = torch.zeros(runner.family.position_rows, n, dtype=torch.long, device=runner.device)
                runner.run_layers(embeds, positions, runner.backend, metadata)
    except Exception as exc:  # inductor, Triton or the C compiler: whatever it raises, the layers stay usable
        uncompile_decoder_layers(language_model)
        return f"{type(exc).__name__}: {exc}"
    return None
