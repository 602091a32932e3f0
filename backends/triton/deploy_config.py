"""A deployment file (YAML): one place for what is otherwise spread over four ``config.pbtxt`` files and the
server's command line. ``python -m backends.triton.launcher --config deploy.yaml`` serves the model repository
rendered from it (``backends.triton.repository``); ``deploy/`` holds examples.

Sections, every key optional (what is left out keeps the repository's value; ``slo.<modality>`` needs both keys):

* ``model``: ``path`` (the checkpoint directory of every model; relative to the file's folder), ``preset``,
  ``dtype``, ``load_format``.
* ``resources``: ``replicas`` (encode_prefill + decode pairs, replica k on GPU k mod GPUs under ``device: auto``),
  ``gpu_sharing`` (``time_slicing``, CUDA's default, or ``mps``: ``backends.triton.mps``), and per stage where it
  runs: ``flashcodec`` (``device``, ``nvdec_gpus``, ``nvdec_processes_per_gpu``, ``decode_threads``),
  ``encode_prefill`` (``device``, ``vision_gpus``, ``vision_parallel``, ``vision_tp_size``, ``prefill_graphs``,
  ``vision_graphs``, ``compile_layers``, ``sms_while_decoding``, ``fewer_sms_kinds``), ``decode`` (``device``); each
  stage's ``sm_share`` (percent of the GPU's SMs under ``mps``) and ``mps_priority`` (``normal`` or ``below_normal``
  under ``mps``). A GPU set is ``own``, ``all`` or a list of ids. Each stage is one Triton instance (its stage-link
  socket is named after its model): a stage is placed by its ``device``, more encode_prefill + decode are ``replicas``.
* ``budgets``: the scheduler's per-step ``prefill_budget`` (LLM tokens) and ``encode_budget`` (vision patches),
  ``max_share``, ``short_prefill_tokens``, ``burst_wait_ms``, ``decode_pace_ms``, ``idle_budget_scale``,
  ``max_model_len`` (tokens), decode's ``max_batch`` (sequences per step).
* ``slo``: per modality (``text``, ``image``, ``video``) ``ttft_ms`` and ``tbt_ms``: the targets of SLO scheduling,
  carried into the orchestrator's parameters (``slo_<modality>_ttft_ms``, ...); they act with the orchestrator
  parameter ``slo_scheduling`` true (``orchestrator.budget_policy``), and the TBT targets bound ``decode_pace_ms``.
* ``pools``: ``kv_pages`` or ``kv_memory_fraction`` (the KV pool as a share of the GPU memory free once decode's
  weights are loaded), ``kv_page_size`` (tokens), ``patch_pages``, ``patch_page_size`` (patches).
* ``ipc``: ``shm_default_byte_size``, the Python backend's shared-memory region per model process (bytes, at least
  4 MiB).

Every section is a frozen dataclass checked in ``__post_init__``; errors are :class:`ConfigError`, naming the file
and the key (``pools.kv_memory_fraction: must be in (0, 1), got 1.5``).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from backends.triton.deploy_yaml import ConfigError, build, read_yaml
from backends.triton.mps import GPU_SHARING, mps_priority, sm_share
from backends.triton.triton_io import MODALITIES, UPPER_BOUNDS, choice_value, gpus_value

DEFAULT_SHM_BYTES = 16 * 1024 * 1024  # the launcher's --backend-config=python,shm-default-byte-size
MIN_SHM_BYTES = 4 << 20  # Triton's Python backend refuses less: "shm-default-byte-size can't be smaller than 4 MiBs"
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _to(target: str):
    """A field whose value sets the repository parameter ``target`` (``MODEL.KEY``, or ``*.KEY`` for every model
    that declares KEY); None (the default) keeps the repository's value."""
    return field(default=None, metadata={"to": target})


def _at_least(section, least: int, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and value < least:
            raise ConfigError(name, f"must be at least {least}, got {value!r}")


def _device(value: str | None, key: str = "device") -> None:
    if value is not None and not _DEVICE.match(value):
        raise ConfigError(key, f"must be auto, cpu or cuda:N, got {value!r}")


def _mps(section) -> None:
    """The stage's own rules for ``sm_share`` and ``mps_priority`` (``backends.triton.mps``), checked at reading."""
    for key, rule in (("sm_share", sm_share), ("mps_priority", mps_priority)):
        value = getattr(section, key)
        if value is not None:
            try:
                rule({key: str(value)})
            except ValueError as exc:
                raise ConfigError(key, str(exc).removeprefix(f"{key} ")) from None


def _choices(section, *keys: str) -> None:
    """Each of ``keys`` set must be one of its words (``triton_io.CHOICES``); a YAML bare on/off (bool) becomes it."""
    for key in keys:
        value = getattr(section, key)
        if isinstance(value, bool):
            object.__setattr__(section, key, value := "on" if value else "off")
        if value is not None:
            try:
                choice_value(key, value, key)
            except ValueError as exc:
                raise ConfigError(key, str(exc).removeprefix(f"{key} ")) from None


def _gpus(value: str | tuple[int, ...] | None, key: str) -> None:
    if value is not None:
        try:
            gpus_value(key, _text(value))
        except ValueError:
            raise ConfigError(key, f"must be own, all or a list of distinct GPU ids, got {value!r}") from None


@dataclass(frozen=True)
class ModelSection:
    """``model``: every model's checkpoint (``path``) or ``preset`` (random weights), ``dtype``, ``load_format``;
    ``generation_config``: ``auto`` (the checkpoint's generation_config.json gives requests their default sampling,
    as vLLM's ``--generation-config auto``) or ``none`` (``orchestrator.generation_defaults``)."""

    path: str | None = _to("*.model_path")
    preset: str | None = _to("*.preset")
    dtype: str | None = _to("*.dtype")
    load_format: str | None = _to("*.load_format")
    generation_config: str | None = _to("orchestrator.generation_config")

    def __post_init__(self):
        _choices(self, "generation_config", "preset", "dtype", "load_format")  # the stages' words (triton_io.CHOICES)
        if self.path is not None and not Path(self.path).is_dir():
            raise ConfigError("path", f"{self.path} is not a directory (a local Qwen2.5-VL or InternVL3 checkpoint)")


@dataclass(frozen=True)
class FlashcodecResources:
    """``resources.flashcodec``: its device; the GPUs whose NVDEC engines decode (a GPU set), processes per GPU,
    decode threads (media items decoded at once)."""

    device: str | None = _to("flashcodec.device")
    nvdec_gpus: str | tuple[int, ...] | None = _to("flashcodec.nvdec_gpus")
    nvdec_processes_per_gpu: int | None = _to("flashcodec.nvdec_processes_per_gpu")
    decode_threads: int | None = _to("flashcodec.decode_threads")
    sm_share: int | None = _to("flashcodec.sm_share")
    mps_priority: str | None = _to("flashcodec.mps_priority")

    def __post_init__(self):
        _device(self.device)
        _mps(self)
        _gpus(self.nvdec_gpus, "nvdec_gpus")
        _at_least(self, 1, "nvdec_processes_per_gpu", "decode_threads")


@dataclass(frozen=True)
class EncodePrefillResources:
    """``resources.encode_prefill``: its device; the vision tower's GPUs (a GPU set), ``data``/``tensor`` parallel,
    GPUs per split tower (``all`` or a number); ``prefill_graphs``, ``vision_graphs``, ``compile_layers`` (auto, on,
    off: ``EncodePrefillWorker``); SMs of the steps the orchestrator marks ``fewer_sms`` (``sms_while_decoding``: 0,
    off, or a number; ``backends.stages.step_streams``) and the modalities whose steps it marks (``fewer_sms_kinds``:
    video, image or video,image; ``orchestrator.fewer_sms``)."""

    device: str | None = _to("encode_prefill.device")
    vision_gpus: str | tuple[int, ...] | None = _to("encode_prefill.vision_gpus")
    vision_parallel: str | None = _to("encode_prefill.vision_parallel")
    vision_tp_size: int | str | None = _to("encode_prefill.vision_tp_size")
    prefill_graphs: str | bool | None = _to("encode_prefill.prefill_graphs")  # YAML reads bare on/off as bools
    vision_graphs: str | bool | None = _to("encode_prefill.vision_graphs")
    compile_layers: str | bool | None = _to("encode_prefill.compile_layers")
    sms_while_decoding: int | None = _to("encode_prefill.sms_while_decoding")
    fewer_sms_kinds: str | None = _to("orchestrator.fewer_sms_kinds")
    sm_share: int | None = _to("encode_prefill.sm_share")
    mps_priority: str | None = _to("encode_prefill.mps_priority")

    def __post_init__(self):
        _device(self.device)
        _mps(self)
        _gpus(self.vision_gpus, "vision_gpus")
        _choices(self, "vision_parallel", "prefill_graphs", "vision_graphs", "compile_layers", "fewer_sms_kinds")
        sms = self.sms_while_decoding
        if sms is not None and sms < 0:
            raise ConfigError("sms_while_decoding", f"must be 0 (off) or a number of SMs, got {sms!r}")
        if isinstance(self.vision_tp_size, str) and self.vision_tp_size != "all":
            raise ConfigError("vision_tp_size", f"must be all or a number of GPUs, got {self.vision_tp_size!r}")
        if isinstance(self.vision_tp_size, int):
            _at_least(self, 1, "vision_tp_size")


@dataclass(frozen=True)
class DecodeResources:
    """``resources.decode``: its device (it owns the KV pool), SM share and MPS priority."""

    device: str | None = _to("decode.device")
    sm_share: int | None = _to("decode.sm_share")
    mps_priority: str | None = _to("decode.mps_priority")

    def __post_init__(self):
        _device(self.device)
        _mps(self)


@dataclass(frozen=True)
class Resources:
    """``resources``: encode_prefill + decode replicas (1-64), how the processes share a GPU (the launcher's
    ``--gpu-sharing``; None: time slicing) and each stage's placement."""

    replicas: int | None = _to("orchestrator.replicas")
    gpu_sharing: str | None = None
    flashcodec: FlashcodecResources = field(default_factory=FlashcodecResources)
    encode_prefill: EncodePrefillResources = field(default_factory=EncodePrefillResources)
    decode: DecodeResources = field(default_factory=DecodeResources)

    def __post_init__(self):
        _at_least(self, 1, "replicas")
        if self.gpu_sharing not in (None, *GPU_SHARING):
            raise ConfigError("gpu_sharing", f"must be {' or '.join(GPU_SHARING)}, got {self.gpu_sharing!r}")
        if self.replicas is not None and self.replicas > UPPER_BOUNDS["replicas"]:
            raise ConfigError("replicas", f"must be at most {UPPER_BOUNDS['replicas']}, got {self.replicas}")


@dataclass(frozen=True)
class Budgets:
    """``budgets``: per scheduler step ``prefill_budget`` (LLM tokens) and ``encode_budget`` (vision-encoder patches
    before the 2x2 merge), ``max_share`` of a budget per request while several want it (0, 1],
    ``short_prefill_tokens`` (prefills this close to their prompt's end go first in short steps; 0 off),
    ``burst_wait_ms`` (ms a step may wait for a burst's requests; 0 off), ``decode_pace_ms`` (ms between decode's
    steps while a step ending image prompts, or more than decode holds, runs; 0 off), ``idle_budget_scale`` (both
    budgets' factor while nothing decodes; 1 off), ``max_model_len`` (tokens), ``default_max_tokens`` (the most output
    tokens of a request whose ``max_tokens`` is null: ``orchestrator.reply_limit``), decode's ``max_batch``
    (sequences)."""

    prefill_budget: int | None = _to("orchestrator.prefill_budget")
    encode_budget: int | None = _to("orchestrator.encode_budget")
    max_share: float | None = _to("orchestrator.max_share")
    short_prefill_tokens: int | None = _to("orchestrator.short_prefill_tokens")
    burst_wait_ms: int | None = _to("orchestrator.burst_wait_ms")
    decode_pace_ms: int | None = _to("orchestrator.decode_pace_ms")
    idle_budget_scale: int | None = _to("orchestrator.idle_budget_scale")
    max_model_len: int | None = _to("orchestrator.max_model_len")
    default_max_tokens: int | None = _to("orchestrator.default_max_tokens")
    max_batch: int | None = _to("decode.max_batch")

    def __post_init__(self):
        _at_least(self, 1, "prefill_budget", "encode_budget", "max_model_len", "default_max_tokens", "max_batch",
                  "idle_budget_scale")
        if self.max_share is not None and not 0 < self.max_share <= 1:
            raise ConfigError("max_share", f"must be in (0, 1], got {self.max_share!r}")
        _at_least(self, 0, "short_prefill_tokens", "burst_wait_ms", "decode_pace_ms")


@dataclass(frozen=True)
class ModalitySlo:
    """Targets for one modality's requests: time to first token and time between tokens, in milliseconds."""

    ttft_ms: float
    tbt_ms: float

    def __post_init__(self):
        for name in ("ttft_ms", "tbt_ms"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(name, f"must be a positive number of milliseconds, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Slo:
    """``slo``: targets per modality (a request with a video counts as video, one with images as image)."""

    text: ModalitySlo | None = None
    image: ModalitySlo | None = None
    video: ModalitySlo | None = None

    def items(self) -> list[tuple[str, str]]:
        return [(f"slo.{modality}.{name}", f"orchestrator.slo_{modality}_{name}={_text(getattr(target, name))}")
                for modality in MODALITIES if (target := getattr(self, modality)) is not None
                for name in ("ttft_ms", "tbt_ms")]


@dataclass(frozen=True)
class Pools:
    """``pools``: the KV pool in pages (``kv_pages``) or as a share of the GPU memory free after decode's weights
    (``kv_memory_fraction``, (0, 1)), ``kv_page_size`` (tokens); the patch pool's pages and ``patch_page_size``
    (patches)."""

    kv_pages: int | None = _to("decode.kv_pages")
    kv_memory_fraction: float | None = _to("decode.kv_memory_fraction")
    kv_page_size: int | None = _to("decode.kv_page_size")
    patch_pages: int | None = _to("flashcodec.patch_pages")
    patch_page_size: int | None = _to("flashcodec.patch_page_size")

    def __post_init__(self):
        _at_least(self, 1, "kv_pages", "kv_page_size", "patch_pages", "patch_page_size")
        if self.kv_pages is not None and self.kv_memory_fraction is not None:
            raise ConfigError("kv_memory_fraction", "give kv_pages or kv_memory_fraction, not both")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction < 1:
            raise ConfigError("kv_memory_fraction", f"must be in (0, 1), got {self.kv_memory_fraction!r}")

    def items(self) -> list[tuple[str, str]]:
        # kv_pages alone in the file: a fraction the repository may hold would win over it (decode_stage)
        return [("pools.kv_pages", "decode.kv_memory_fraction=")] if self.kv_pages is not None else []


@dataclass(frozen=True)
class Ipc:
    """``ipc``: the Python backend's shared-memory region per model process, bytes (it grows beyond, per request),
    at least ``MIN_SHM_BYTES``."""

    shm_default_byte_size: int = DEFAULT_SHM_BYTES

    def __post_init__(self):
        if self.shm_default_byte_size < MIN_SHM_BYTES:
            raise ConfigError("shm_default_byte_size", f"must be at least {MIN_SHM_BYTES} (4 MiB, the least Triton's "
                                                       f"Python backend takes), got {self.shm_default_byte_size}")


@dataclass(frozen=True)
class DeployConfig:
    """A deployment file, checked (see the module docstring)."""

    model: ModelSection = field(default_factory=ModelSection)
    resources: Resources = field(default_factory=Resources)
    budgets: Budgets = field(default_factory=Budgets)
    slo: Slo = field(default_factory=Slo)
    pools: Pools = field(default_factory=Pools)
    ipc: Ipc = field(default_factory=Ipc)

    def __post_init__(self):
        if self.pools.kv_memory_fraction is not None and self.resources.decode.device == "cpu":
            raise ConfigError("pools.kv_memory_fraction", "sizes the KV pool from free GPU memory, but "
                                                          "resources.decode.device is cpu: set pools.kv_pages instead")

    def set_items(self) -> list[str]:
        """The repository parameters this file sets, as the launcher's ``--set`` items (``MODEL.KEY=VALUE``)."""
        return [item for _, item in self.keyed_items()]

    def keyed_items(self) -> list[tuple[str, str]]:
        """:meth:`set_items`, each after the dotted file key that sets it (``("budgets.max_model_len",
        "orchestrator.max_model_len=4096")``): what an error in the item names."""
        return [*_items(self), *self.slo.items(), *self.pools.items()]

    @classmethod
    def load(cls, path: Path) -> "DeployConfig":
        """Read and check the YAML file ``path``. Raises ConfigError (its message starts with the file's name)
        for a file that cannot be read or parsed, a key given twice, an unknown or missing key, or a value of the
        wrong type or range (``deploy_yaml``)."""
        path = Path(path)
        data = read_yaml(path)
        model = (data or {}).get("model") if isinstance(data, dict) else None
        if isinstance(model, dict) and isinstance(model.get("path"), str):  # relative to the file, not the caller
            data["model"] = {**model, "path": str((path.parent / model["path"]).resolve())}
        try:
            return build(cls, data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc.key}", exc.message) from None


def _text(value: object) -> str:
    """A parameter's string: ``[0, 1]`` -> ``0,1``, ``500.0`` -> ``500``."""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _items(section, where: str = "") -> list[tuple[str, str]]:
    """(dotted key, ``MODEL.KEY=VALUE``) for each field of ``section`` (and its sections, under ``where``) that is set
    and names a target."""
    items = []
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{where}{f.name}"
        if dataclasses.is_dataclass(value):
            items += _items(value, f"{key}.")
        elif value is not None and "to" in f.metadata:
            items.append((key, f"{f.metadata['to']}={_text(value)}"))
    return items
