"""Reading and writing Triton Python-backend tensors (used by every model.py and stage).

``triton_python_backend_utils`` exists only inside the backend stub, so it is imported lazily.
"""
from __future__ import annotations

import faulthandler
import json
import math
import signal
import sys
import time

import numpy as np

from backends.runtime.presets import DTYPES, LOAD_FORMATS, PRESETS


def pb():
    """The ``triton_python_backend_utils`` module (only importable inside the Python-backend stub). Looked up in
    ``sys.modules`` first: it is called for every response, and an ``import`` statement's own checks cost more."""
    module = sys.modules.get("triton_python_backend_utils")
    if module is None:
        import triton_python_backend_utils as module
    return module


def yield_gil() -> None:
    """Let a waiting thread have the GIL after a custom metric's ``set``, which the 2.51 stub makes without letting
    go of it through its round trip to Triton (python_backend r24.10 ``src/metric.cc``, ``SendSetValueRequest``;
    ``increment``, ``observe``, ``is_cancelled`` and a response's ``send`` let go of it): a send of the gauges that
    changed, set back to back, held it from the other threads for up to the interpreter's switch interval (5 ms: a
    stall of the orchestrator's event loop and send lanes, every stream's token late at once); ``time.sleep(0)`` lets
    go of it. Python threads holding the GIL in C calls back to back, 50 us each: another thread's 1-ms ticker late
    by 5.3 ms at p99 (8.2 max), and by 0.19 ms with a ``sleep(0)`` between calls (2-core CPU machine, 2026-12-04)."""
    time.sleep(0)


def enable_stack_dumps() -> None:
    """Tracebacks of all threads to the server log on a crash, and on SIGUSR1 (what the launcher sends
    to the stubs before stopping a server that hangs, when UNIFIEDSERVE_DUMP_STACKS=1)."""
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def parameters(args: dict) -> dict[str, str]:
    """The model's config.pbtxt ``parameters`` as {key: string_value}."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


# Sizes and counts among the models' parameters: below 1 none of them can work. backends/triton/repository.py
# checks the launcher's --set values with the same rule (int_value) before a server starts.
INT64_LIMIT = 1 << 63
UPPER_BOUNDS = {"replicas": 64}  # stage replicas: models written and loaded, a few GPUs' worth each
POSITIVE_INT_PARAMETERS = frozenset({
    "kv_pages", "kv_page_size", "max_batch",                          # decode
    "patch_pages", "patch_page_size", "decode_threads",               # flashcodec
    "encode_budget", "prefill_budget", "max_model_len", "max_media_bytes", "max_prompt_bytes", "replicas",  # orch.
    "max_image_pixels", "max_media_items", "max_waiting_requests", "idle_budget_scale", "default_max_tokens",
    "vision_tp_size",                                                 # encode_prefill
})
NON_NEGATIVE_INT_PARAMETERS = frozenset({"sms_while_decoding", "burst_wait_ms", "decode_pace_ms"})  # 0: off
MODALITIES = ("text", "image", "video")  # what a request counts as (any video: video; any image: image)
# Parameters that are positive numbers when set (empty: unset): float_parameter reads them; the launcher checks --set
POSITIVE_FLOAT_PARAMETERS = frozenset({*(f"slo_{m}_{t}_ms" for m in MODALITIES for t in ("ttft", "tbt")),
                                       "gil_switch_interval_ms"})
FLOAT_UPPER_BOUNDS = {"gil_switch_interval_ms": 1000.0}  # a GIL held a second by one thread: no process serves so
# Parameters that take one of a few words: the launcher checks --set values (repository.check_value), the stages and
# workers what they are given (choice_value).
SWITCHES = ("auto", "on", "off")
CHOICES = {"cuda_graphs": SWITCHES, "compile_layers": SWITCHES, "overlap_steps": SWITCHES, "prefill_graphs": SWITCHES,
           "vision_graphs": SWITCHES,
           "share_weights": ("on", "off"), "serial_joins": ("on", "off"), "hold_joins": ("on", "off"),
           "vision_parallel": ("data", "tensor"),
           "fewer_sms_kinds": ("video", "image", "video,image", "video,text", "video,image,text"),  # orchestrator.fewer_sms
           "generation_config": ("auto", "none"),  # orchestrator.generation_defaults
           "chat_template_content_format": ("auto", "string", "openai"),  # orchestrator.content_format
           # the served model's (ModelSpec, backends.runtime.loader, checks them at load; the launcher before)
           "preset": tuple(sorted(PRESETS)), "dtype": DTYPES, "load_format": LOAD_FORMATS}


def choice_value(key: str, value: str, name: str | None = None) -> str:
    """``value`` of a parameter in CHOICES, if it is one of that parameter's words.

    Raises ValueError naming ``name`` (default: "parameter KEY"), the words and the value given.
    """
    if key in CHOICES and value not in CHOICES[key]:
        raise ValueError(f"{name or f'parameter {key}'} must be {', '.join(CHOICES[key][:-1])} or "
                         f"{CHOICES[key][-1]}, got {value!r}")
    return value


def switched_on(value: str, auto: bool) -> bool:
    """Whether a parameter of ``SWITCHES`` (checked by :func:`choice_value`) is on: ``"on"``, or ``"auto"`` where
    ``auto`` (the stage's rule for it) holds."""
    return value == "on" or (value == "auto" and auto)


def int_value(key: str, value: str, name: str | None = None) -> int:
    """A parameter's string ``value`` as an int; >= 1 when ``key`` is in POSITIVE_INT_PARAMETERS, >= 0 in
    NON_NEGATIVE_INT_PARAMETERS.

    Raises ValueError naming ``name`` (default: "parameter KEY") and the value: empty, not an integer,
    a size below 1 or a count below 0, above its ``UPPER_BOUNDS`` entry, or beyond 64 bits.
    """
    name = name or f"parameter {key}"
    if not value.strip():
        raise ValueError(f"{name} must be an integer, got an empty value")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if key in POSITIVE_INT_PARAMETERS and number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if key in NON_NEGATIVE_INT_PARAMETERS and number < 0:
        raise ValueError(f"{name} must be 0 or more, got {value!r}")
    if key in UPPER_BOUNDS and number > UPPER_BOUNDS[key]:
        raise ValueError(f"{name} must be at most {UPPER_BOUNDS[key]}, got {value!r}")
    if not -INT64_LIMIT <= number < INT64_LIMIT:  # the stages hand sizes and counts to C (torch, numpy) as int64
        raise ValueError(f"{name} must fit in 64 bits (|value| below 2**63), got {value!r}")
    return number


def int_parameter(params: dict[str, str], key: str, default: int | None = None) -> int:
    """``params[key]`` (from :func:`parameters`) as an int (:func:`int_value`); ``default`` when absent.

    Raises ValueError naming the parameter: absent without a default, or a bad value (see int_value).
    """
    if key not in params:
        if default is None:
            raise ValueError(f"parameter {key} is missing from config.pbtxt")
        return default
    return int_value(key, params[key])


def float_parameter(params: dict[str, str], key: str, default: float | None = None) -> float | None:
    """``params[key]`` as a positive finite number (at most ``FLOAT_UPPER_BOUNDS[key]`` where it has one);
    ``default`` when absent or empty. Raises ValueError naming the parameter and the value otherwise."""
    text = params.get(key, "").strip()
    if not text:
        return default
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and 0 < number <= FLOAT_UPPER_BOUNDS.get(key, math.inf)):
        raise ValueError(f"parameter {key} must be {float_requirement(key)}, got {params[key]!r}")
    return number


def float_requirement(key: str) -> str:
    """What :func:`float_parameter` takes for ``key``: ``"a positive number"`` (``"... of at most N"``)."""
    upper = FLOAT_UPPER_BOUNDS.get(key)
    return "a positive number" + (f" of at most {upper:g}" if upper is not None else "")


def gpus_value(key: str, value: str) -> str | list[int] | None:
    """A GPU-set parameter: "own" (the instance's GPU alone) -> None, "all" -> "all" (every GPU the process sees,
    its own first), "0,1" -> [0, 1]. Raises ValueError naming the parameter and the value."""
    text = value.strip().lower()
    if text in ("", "own"):
        return None
    if text == "all":
        return "all"
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ValueError(f'parameter {key} must be "own", "all" or distinct GPU ids like "0,1", got {value!r}')
    return ids


def input_arrays(request) -> dict[str, np.ndarray]:
    """Every input of a Triton request, by name, as numpy arrays: one pass over ``request.inputs()`` (the stub's
    ``get_input_tensor_by_name`` walks that list, built anew, on every call)."""
    return {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}


def bytes_list(arrays: dict[str, np.ndarray], name: str) -> list[bytes]:
    """All elements of BYTES input ``name`` of ``arrays`` (:func:`input_arrays`) as bytes ([] when absent)."""
    array = arrays.get(name)
    if array is None:
        return []
    return [x if isinstance(x, bytes) else str(x).encode() for x in np.ravel(array)]


def int_list(arrays: dict[str, np.ndarray], name: str) -> list[int] | None:
    """All elements of integer input ``name`` of ``arrays`` (:func:`input_arrays`) as ints (None when absent; an
    input of no elements is [])."""
    array = arrays.get(name)
    return None if array is None else np.ravel(array).astype(np.int64).tolist()


def boolean(arrays: dict[str, np.ndarray], name: str, default: bool) -> bool:
    """BOOL input ``name`` of ``arrays`` (:func:`input_arrays`); ``default`` when absent or empty."""
    array = arrays.get(name)
    return default if array is None or array.size == 0 else bool(np.ravel(array)[0])


def str_tensor(name: str, values: list[str] | list[bytes]):
    data = np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)
    return pb().Tensor(name, data)


def number_tensor(name: str, values: list[int] | list[float], dtype=np.int64):
    return pb().Tensor(name, np.asarray(values, dtype=dtype))


INTERNAL_ONLY = "this model is internal to UnifiedServe: send requests to the 'orchestrator' model"


class InternalModel:
    """A stage model: the orchestrator drives it over the stage link, and clients' requests are refused."""

    def execute(self, requests):
        return [error(INTERNAL_ONLY) for _ in requests]


def naming_request(message: str, request_id: str) -> str:
    """``message`` followed by `` [request id: <id>]`` where the client gave its request an id, else as it is. Triton
    2.51 passes a decoupled model's error on a gRPC stream without the request's id, so a client that sends several
    requests on one stream (tritonclient's ``start_stream``) could not tell whose error it is; Triton's own errors
    name it in the same words (before the message: here after it, so that a message still starts with the input at
    fault, docs/design.md invariant 3)."""
    return f"{message} [request id: {request_id}]" if request_id else message


def error(message: str, invalid_argument: bool = True, unavailable: bool = False, request_id: str = ""):
    """An InferenceResponse carrying a TritonError: UNAVAILABLE when ``unavailable`` (overloaded: retry later),
    else INVALID_ARG for bad input, INTERNAL otherwise; its message names ``request_id`` (:func:`naming_request`)."""
    p = pb()
    code = p.TritonError.UNAVAILABLE if unavailable else (
        p.TritonError.INVALID_ARG if invalid_argument else p.TritonError.INTERNAL)
    return p.InferenceResponse(error=p.TritonError(naming_request(message, request_id), code))


class WeightsGauge:
    """The gauge ``unifiedserve_lm_weight_bytes{model, replica, copy}``: bytes of language-model weights a stage
    holds as its own copy (``copy="own"``) and as views of the copy shared between decode and encode_prefill
    (``copy="shared"``, ``backends.ipc.shared_weights``); a replica's memory for them is its stages' "own" plus one
    "shared". ``set`` makes the round trip to the Triton process only when the figures change."""

    NAME = "unifiedserve_lm_weight_bytes"

    def __init__(self, model: str, replica: int):
        p = pb()
        self.family = p.MetricFamily(self.NAME, "bytes of language-model weights a stage holds, by copy: its own "
                                     "or the one shared by decode and encode_prefill", p.MetricFamily.GAUGE)
        self.series = {copy: self.family.Metric(labels={"model": model, "replica": str(replica), "copy": copy})
                       for copy in ("own", "shared")}
        self.last: dict[str, int] = {}

    def set(self, held: dict[str, int]) -> None:
        """``held``: {"own": bytes, "shared": bytes}, as ``shared_weights.held_bytes`` gives."""
        if self.series and held != self.last:
            for copy, value in held.items():
                self.series[copy].set(value)
            self.last = dict(held)

    def close(self) -> None:
        """For ``finalize``: drop the series, then the family (metrics alive when the stub exits crash it,
        triton-inference-server/server#8662); later ``set`` calls do nothing."""
        self.series, self.family, self.last = {}, None, {}
