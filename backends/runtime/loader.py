"""Builds a family's transformers model: seeded dummy weights from a preset, or a local checkpoint (its config.json's
``model_type`` picks the family: ``families.registry``)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from backends.runtime import model_parts
from backends.runtime.families import ServedModel
from backends.runtime.families.registry import family_for, model_config, model_tokenizer
from backends.runtime.presets import DTYPES, LOAD_FORMATS, PRESETS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """What to load.

    * ``load_format="auto"`` (default): the weights of the checkpoint directory ``model_path`` (no downloads);
      without a path, those of ``dummy`` (a preset has no weights).
    * ``load_format="dummy"``: random weights seeded by ``seed``; the architecture is ``preset``, or the
      checkpoint's config when ``model_path`` is given (vLLM's meaning: for benchmarks; logged, since the
      answers are then meaningless). Identical bits in every process on the same kind of device (CPU and
      CUDA draw different numbers).
    * ``dtype``: a torch dtype name, or ``"auto"`` for the preset's (``qwen2_5_vl_7b``, ``internvl3_38b``:
      bfloat16) or the checkpoint's.
    * ``device``: a torch device string, e.g. ``"cpu"`` or ``"cuda:0"``.

    Raises ValueError for an unknown format, preset or dtype, or a bad device.
    """

    preset: str = "tiny"
    model_path: str | None = None
    load_format: str = "auto"
    dtype: str = "float32"
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.model_path is None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        torch.device(self.device)  # raises RuntimeError for a malformed string
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @classmethod
    def from_parameters(cls, params: dict[str, str], device: str = "cpu") -> "ModelSpec":
        """Spec from Triton model parameters (string values).

        Reads the keys ``preset``, ``model_path``, ``load_format``, ``dtype`` and ``seed``; other keys are
        left to their owners, and empty strings mean "default". Raises ValueError for a non-integer seed
        and whatever ``__post_init__`` rejects.
        """
        names = {f.name for f in fields(cls)} - {"device"}
        values: dict[str, object] = {k: v for k, v in params.items() if k in names and v != ""}
        if "seed" in values:
            try:
                values["seed"] = int(values["seed"])
            except ValueError:
                raise ValueError(f"parameter seed must be an integer, got {values['seed']!r}") from None
        return cls(**values, device=device)


def checkpoint_bytes(model_path: str) -> int:
    """Bytes of the weight files (``*.safetensors``, ``*.bin``) in the checkpoint directory ``model_path``: what
    :func:`load_model` reads into host memory."""
    return sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin") for p in Path(model_path).glob(pattern))


def host_available_bytes() -> int | None:
    """The host memory available to new allocations (Linux ``/proc/meminfo`` MemAvailable, bytes); None elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib * 1024


def _torch_dtype(name: str, default: torch.dtype) -> torch.dtype:
    return default if name == "auto" else getattr(torch, name)


def load_model(spec: ModelSpec, parts: tuple[str, ...] = model_parts.PARTS
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (eval mode, on ``spec.device``, in the spec's dtype) and its tokenizer: the family's transformers
    class (``Qwen2_5_VLForConditionalGeneration``, ``InternVLForConditionalGeneration``).

    Vision tower and language model use the ``sdpa`` attention of transformers; a ModelRunner later
    routes the language model's attention through the paged KV cache. ``parts``: the parts given memory
    (``model_parts.PARTS``); the others stay on the meta device (dummy weights: ``model_parts.materialize`` builds
    them later with the same values; a checkpoint's are read whole into host memory, then let go). Raises OSError when
    ``model_path`` is not a directory or lacks a config, weights or tokenizer; ValueError when its config's
    ``model_type`` is of no family.
    """
    served = ServedModel.read(spec.preset, spec.model_path)  # first: it says when model_path is no directory
    tokenizer = model_tokenizer(served)
    config = model_config(served, tokenizer)
    device = torch.device(spec.device)
    if spec.load_format == "auto" and spec.model_path is not None:
        log.info("loading the weights of %s onto %s", spec.model_path, device)
        model = family_for(config).model_class.from_pretrained(
            spec.model_path, local_files_only=True, attn_implementation="sdpa",
            dtype=_torch_dtype(spec.dtype, config.dtype or torch.float32))
        model_parts.keep(model, device, parts)
        return model.eval(), tokenizer

    if spec.model_path is not None:
        log.warning("load_format=dummy: random weights (seed %d) in the architecture of %s, not its weights",
                    spec.seed, spec.model_path)
    dtype = _torch_dtype(spec.dtype, config.dtype or torch.float32)
    log.info("building %s with random weights on %s (%s)", spec.model_path or f"preset {spec.preset}", device,
             ", ".join(parts))
    return model_parts.build(family_for(config).model_class, config, dtype, device, spec.seed, parts), tokenizer
