"""A model held by parts: each stage gives memory only to the part it runs. A model has two parts: ``"vision"``
(parameters and buffers named with one of its family's ``vision_prefixes``) and ``"language_model"`` (the rest,
``lm_head`` included). A part left out stays on the meta device (no memory); modules that hold buffers alone (rotary
``inv_freq`` tables, a few KB) always get theirs, since a stage that maps another's parameters still needs them.

So decode holds no vision tower, and encode_prefill leaves the language model out while it waits to map decode's
copy (``backends.ipc.shared_weights``): InternVL3-38B's two 70-GiB copies would not fit one H200 at start.

* Dummy weights (:func:`build`, :func:`materialize`): the model is built on the meta device and each module of the
  chosen parts is initialised by the ``_init_weights`` of its closest enclosing ``PreTrainedModel`` (as
  ``PreTrainedModel.initialize_weights`` dispatches it: normal(0, ``initializer_range``) linear and embedding
  weights, unit norms, rotary tables, the vision tower's own rules), from a generator seeded by the run's seed and the
  module's name: a part built alone, later or in another process is bit for bit the part of a whole build.
* A checkpoint's weights (:func:`keep`): loaded whole, then the chosen parts moved to the device and the others let
  go.
"""
from __future__ import annotations

import zlib
from typing import Iterable

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from backends.runtime.families.registry import family_for

PARTS = ("vision", "language_model")


def build(model_class: type[PreTrainedModel], config: PreTrainedConfig, dtype: torch.dtype, device: torch.device,
          seed: int, parts: Iterable[str] = PARTS) -> PreTrainedModel:
    """``model_class`` for ``config`` in ``dtype``, eval mode, with :func:`materialize`'s weights on ``device`` for
    ``parts``; the other parts stay on the meta device. Raises as :func:`materialize`."""
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=dtype, attn_implementation="sdpa")
    materialize(model, device, seed, parts)
    return model.eval()


def materialize(model: PreTrainedModel, device: torch.device, seed: int, parts: Iterable[str] = PARTS) -> None:
    """Give ``model``'s tensors of ``parts`` (:data:`PARTS`) that are still on the meta device memory on ``device`` and
    their seeded dummy values (module docstring); the caller's random state is left as it was. Raises ValueError for
    an unknown part, RuntimeError naming floating-point tensors that transformers' initialisation left unset (they
    would hold whatever the memory held)."""
    chosen = [(name, module, owner) for name, module, owner in _modules(model, parts)
              if any(t.is_meta for t in _own_tensors(module))]
    gpu = (torch.cuda.current_device() if device.index is None else device.index) if device.type == "cuda" else None
    with torch.random.fork_rng(devices=[] if gpu is None else [gpu], device_type=device.type), torch.no_grad():
        for name, module, owner in chosen:
            module.to_empty(device=device, recurse=False)
            for tensor in _own_tensors(module):
                if tensor.is_floating_point():
                    tensor.fill_(float("nan"))  # what an init that missed a tensor would leave: caught below
            _seed(gpu, zlib.crc32(f"{seed}:{name}".encode()))
            owner._init_weights(module)
        unset = [f"{name}.{key}" if name else key for name, module, _ in chosen
                 for key, tensor in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
                 if tensor.is_floating_point() and bool(tensor.isnan().any())]
    if unset:
        raise RuntimeError(f"dummy weights: transformers' initialisation left {len(unset)} tensors unset: "
                           f"{', '.join(unset[:8])}")
    model.tie_weights()  # a tensor shared by two modules was given memory once for each


def keep(model: PreTrainedModel, device: torch.device, parts: Iterable[str] = PARTS) -> None:
    """``model``'s loaded tensors of ``parts`` (and of buffer-only modules) moved to ``device``; the other parameters
    let go (meta: no memory). Raises ValueError for an unknown part."""
    chosen = {id(module) for _, module, _ in _modules(model, parts)}
    with torch.no_grad():
        for module in model.modules():
            for key, p in module._parameters.items():
                if p is not None:
                    moved = p.data.to(device) if id(module) in chosen else p.data.to("meta")
                    module._parameters[key] = nn.Parameter(moved, requires_grad=p.requires_grad)
            if id(module) in chosen:
                for key, b in module._buffers.items():
                    if b is not None:
                        module._buffers[key] = b.to(device)
    model.tie_weights()


def _modules(model: PreTrainedModel, parts: Iterable[str]):
    """(name, module, the PreTrainedModel whose ``_init_weights`` applies to it) for the modules of ``parts`` and
    those holding buffers alone. Raises ValueError for an unknown part."""
    parts = set(parts)
    if not parts <= set(PARTS):
        raise ValueError(f"parts must be among {PARTS}, got {sorted(parts)}")
    vision = family_for(model.config).vision_prefixes
    owners: dict[str, PreTrainedModel] = {}
    for name, module in model.named_modules():
        owners[name] = module if isinstance(module, PreTrainedModel) else owners[name.rpartition(".")[0]]
        part = "vision" if f"{name}.".startswith(vision) else "language_model"
        if part in parts or not any(True for _ in module.parameters(recurse=False)):
            yield name, module, owners[name]


def _seed(gpu: int | None, seed: int) -> None:
    """Seed the CPU's generator and GPU ``gpu``'s (None: none), no other GPU's: ``fork_rng`` restores only these."""
    torch.random.default_generator.manual_seed(seed)
    if gpu is not None:
        torch.cuda.default_generators[gpu].manual_seed(seed)


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]
