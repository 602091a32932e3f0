"""Seeded dummy weights that any process can build a part of: the model is built on the meta device (no memory) and
only the parts a stage needs get memory and values, each module's tensors from a generator seeded by the run's seed
and the module's name. So a tensor's value does not depend on which other parts were built, when, or in which
process: encode_prefill can leave the language model unbuilt while it waits to map decode's copy
(``backends.ipc.shared_weights``) and build it later, bit for bit as decode did, if it cannot map it.

The values are transformers' own: each module is initialised by the ``_init_weights`` of the closest enclosing
``PreTrainedModel`` (as ``PreTrainedModel.initialize_weights`` dispatches it: the vision tower's own rules for its
modules, normal(0, ``initializer_range``) linear and embedding weights, unit norms, rotary ``inv_freq`` buffers).

A model has two parts: ``"vision"`` (parameters and buffers named with one of its family's ``vision_prefixes``) and
``"language_model"`` (the rest, ``lm_head`` included). Modules that hold buffers alone (rotary ``inv_freq`` tables,
a few KB) are always built: a stage that maps another's parameters still needs them.
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
    ``parts``; the other parts' tensors stay on the meta device (no memory). Raises as :func:`materialize`."""
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=dtype, attn_implementation="sdpa")
    materialize(model, device, seed, parts)
    return model.eval()


def materialize(model: PreTrainedModel, device: torch.device, seed: int, parts: Iterable[str] = PARTS) -> None:
    """Give ``model``'s tensors of ``parts`` (:data:`PARTS`) that are still on the meta device memory on ``device`` and
    their seeded values (module docstring); the caller's random state is left as it was. Raises ValueError for an
    unknown part, RuntimeError naming floating-point tensors that transformers' initialisation left unset (they
    would hold whatever the memory held)."""
    parts = set(parts)
    if not parts <= set(PARTS):
        raise ValueError(f"parts must be among {PARTS}, got {sorted(parts)}")
    vision = family_for(model.config).vision_prefixes
    owners: dict[str, PreTrainedModel] = {}
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        owners[name] = module if isinstance(module, PreTrainedModel) else owners[parent]
        part = "vision" if f"{name}.".startswith(vision) else "language_model"
        unbuilt = any(t.is_meta for t in _own_tensors(module))
        if unbuilt and (part in parts or not any(True for _ in module.parameters(recurse=False))):
            chosen.append((name, module))
    fork = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork, device_type=device.type), torch.no_grad():
        for name, module in chosen:
            module.to_empty(device=device, recurse=False)
            for tensor in _own_tensors(module):
                if tensor.is_floating_point():
                    tensor.fill_(float("nan"))  # what an init that missed a tensor would leave: caught below
            torch.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            owners[name]._init_weights(module)
        unset = [f"{name}.{key}" if name else key for name, module in chosen
                 for key, tensor in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
                 if tensor.is_floating_point() and bool(tensor.isnan().any())]
    if unset:
        raise RuntimeError(f"dummy weights: transformers' initialisation left {len(unset)} tensors unset: "
                           f"{', '.join(unset[:8])}")
    model.tie_weights()  # a tensor shared by two modules was given memory once for each


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]
