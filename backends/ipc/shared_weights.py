"""One copy of the language model's weights for a replica's decode and encode_prefill stages (issue 4, item 4).

Both stages load the same model (``loader.load_model``), and the language model is most of it: 7.1 of
Qwen2.5-VL-7B's 8.3 billion parameters, 14 GiB in bf16, held twice on one GPU. The decode stage (the owner, as
of the KV pool) copies its language-model parameters into one flat shared tensor (``shared_tensor``: CUDA IPC,
or /dev/shm on the CPU) and points them at views of it (``publish``); encode_prefill maps that tensor when it
first runs and points its own language-model parameters at the same views, letting its copy go (``adopt``).
The vision tower stays in encode_prefill alone. A manifest of names, shapes and dtype is published with the
tensor; a stage whose model differs keeps its own copy (and says why).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from backends.ipc import shared_tensor
from backends.runtime.families.registry import family_for

log = logging.getLogger(__name__)
STAGING_MARGIN_BYTES = 4 << 30  # free memory kept beyond a second copy before publish copies on the device


def lm_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The language model's parameters (everything but the vision side: the family's ``vision_prefixes``), tied ones
    once, in module order."""
    vision = family_for(model.config).vision_prefixes
    return [(name, p) for name, p in model.named_parameters() if not name.startswith(vision)]


def held_bytes(model: nn.Module, shared: shared_tensor.SharedTensor | None) -> dict[str, int]:
    """Bytes of ``model``'s language-model weights by where they live: ``{"own": n, "shared": 0}`` for a stage
    that keeps its own copy, ``{"own": 0, "shared": n}`` for one whose parameters are views of the shared
    tensor (``shared``: what ``publish`` or ``adopt`` returned). Exposed as a gauge (``triton_io.WeightsGauge``)."""
    total = sum(p.numel() * p.element_size() for _, p in lm_parameters(model) if not p.is_meta)  # meta: unbuilt
    return {"own": 0, "shared": total} if shared is not None else {"own": total, "shared": 0}


def rebind(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Make each parameter of ``model`` named in ``tensors`` (as :func:`lm_parameters` names it) hold that tensor,
    wherever the parameter is used (tied ones too). Unlike ``p.data = tensor``, this works for parameters on the
    meta device (unbuilt: ``backends.runtime.model_parts``)."""
    new: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters():  # tied parameters once, by their first name
        if name in tensors:
            new[id(p)] = nn.Parameter(tensors[name], requires_grad=p.requires_grad)
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None and id(p) in new:
                module._parameters[key] = new[id(p)]


def _manifest(params: list[tuple[str, nn.Parameter]]) -> list[list]:
    return [[name, list(p.shape)] for name, p in params]


def _slices(params: list[tuple[str, nn.Parameter]], flat: torch.Tensor):
    """(parameter, its slice of ``flat`` shaped like it), in ``params`` order, back to back."""
    offset = 0
    for _, p in params:
        yield p, flat[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()


def publish(model: nn.Module, name: str, device: torch.device) -> shared_tensor.SharedTensor:
    """Owner side: copy ``model``'s language-model parameters (all of one dtype, on ``device``) into the shared
    tensor ``name`` and make them views of it (through host memory when the device lacks room for both copies and
    :data:`STAGING_MARGIN_BYTES`). Returns the shared tensor (``release()`` it at shutdown).
    Raises ValueError when the parameters are of several dtypes."""
    params = lm_parameters(model)
    dtypes = {p.dtype for _, p in params}
    if len(dtypes) != 1:
        raise ValueError(f"language-model parameters of several dtypes {sorted(map(str, dtypes))}: not shared")
    dtype = dtypes.pop()
    total = sum(p.numel() for _, p in params)
    nbytes = total * params[0][1].element_size()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # this process's cached blocks count as free for the check below
        if torch.cuda.mem_get_info(device)[0] < nbytes + STAGING_MARGIN_BYTES:
            # no room for a second copy (InternVL3-38B's 64 GB beside encode_prefill's vision tower on one H200):
            # the parameters wait in host memory while the shared tensor takes their place
            log.info("language-model weights staged in host memory (%.2f GiB) to be shared", nbytes / 2**30)
            for _, p in params:
                p.data = p.data.cpu()
            torch.cuda.empty_cache()
    shared = shared_tensor.create(name, (total,), dtype, device, extra={"manifest": _manifest(params)})
    with torch.no_grad():
        for p, view in _slices(params, shared.tensor):
            view.copy_(p)
            p.data = view
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the copies the parameters held before
    log.info("language-model weights shared as %r: %d parameters, %.2f GiB", name, total,
             total * shared.tensor.element_size() / 2**30)
    return shared


def adopt(model: nn.Module, name: str, device: torch.device) -> shared_tensor.SharedTensor | None:
    """Mapper side: point ``model``'s language-model parameters at the shared tensor ``name`` when its owner has
    published it and it matches (names, shapes, dtype, device); returns it (keep it referenced), else None with
    the reason logged (the model keeps its own weights)."""
    try:
        meta = shared_tensor.describe(name, timeout_s=0)
    except TimeoutError:
        log.info("no shared language-model weights %r: this stage holds its own copy", name)
        return None
    params = lm_parameters(model)
    dtypes = {p.dtype for _, p in params}
    why = ("the models differ" if meta.get("manifest") != _manifest(params) else
           f"dtype {meta['dtype']} against {sorted(map(str, dtypes))}" if dtypes != {getattr(torch, meta["dtype"])} else
           f"device {meta['device']} against {device}" if torch.device(meta["device"]) != device else "")
    if why:  # equal manifests (names and shapes) mean equal sizes
        log.warning("shared language-model weights %r not used (%s): this stage holds its own copy", name, why)
        return None
    try:
        shared = shared_tensor.open_(name, timeout_s=0)
    except Exception as exc:  # a handle that will not map: serve from this stage's own copy rather than not at all
        log.warning("shared language-model weights %r could not be mapped (%s: %s): this stage holds its own copy",
                    name, type(exc).__name__, exc)
        return None
    had_copy = not all(p.is_meta for _, p in params)  # else: built without one (backends.runtime.model_parts)
    rebind(model, {name: view for (name, _), (_, view) in zip(params, _slices(params, shared.tensor))})
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log.info("language-model weights mapped from %r%s", name, ": this stage's own copy let go" if had_copy else "")
    return shared
