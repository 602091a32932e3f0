"""Start, find and stop the two systems of the peer benchmark, each as its users start it.

* ``unifiedserve``: ``python -m backends.triton.launcher --openai-port PORT`` serving the weightless checkpoint
  (``--model DIR --set '*.load_format=dummy'`` and the model's settings, ``bench.peer.models``: for the default
  Qwen2.5-VL-7B the serve bench's, bf16, 16,384 KV pages, ``max_model_len`` 128,000), the media folder allowed
  (``UNIFIEDSERVE_MEDIA_DIRS``); smoke: the tiny default model.
* ``vllm``: ``python3 -m vllm.entrypoints.openai.api_server`` as the workspace's vllm-bundle.sh tool starts it
  (``--load-format dummy --dtype bfloat16 --allowed-local-media-path``, ``HF_HUB_OFFLINE=1``,
  ``VLLM_USE_FLASHINFER_SAMPLER=0``, and no ``STUB_SITE``), with the model's arguments (``bench.peer.models``:
  max-model-len, images and videos a prompt, batched tokens, how its video loader and processor sample frames),
  the prefix and multimodal-processor caches off (the benchmark repeats the same media), the bundle's folder first
  on ``PYTHONPATH``: with both off, vLLM 0.26 names each media item by its request's id (``vllm/renderers/base.py``,
  ``_process_mm_uuids``), so no encoder output or feature is reused across requests. UnifiedServe's prefix and
  encoder caches are off too (``orchestrator.prefix_caching=false``, ``orchestrator.encoder_cache_tokens=0``). With
  ``caches`` (issue 21's cache scenarios) both systems' caches are left at their defaults: on.

A server is started in a session of its own (``setsid``), so it outlives the command that started it (a device
call): its pid, URL, model name and log are written to ``<state>/<system>.json``, which later commands read and
``stop`` removes after stopping that process group (SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``). UnifiedServe's
launcher writes tritonserver's output and the OpenAI API's to files of its own (``/tmp/unifiedserve-run-*.log``, named
in its output): ``stop`` copies their last ``KEPT_LOG_BYTES`` beside the system's log, so that they come back with the
results (the stages' warnings, e.g. a long garbage collection's pause, are only there).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from backends.triton.deploy_config import DeployConfig
from backends.triton.launcher import REPO_ROOT
from backends.triton.ports import ServerPorts
from bench.peer.models import DEFAULT, MODELS, PeerModel

SYSTEMS = ("unifiedserve", "vllm")
PORTS = {"unifiedserve": 9000, "vllm": 9001}  # the OpenAI APIs'
STOP_TIMEOUT_S = 60.0
KEPT_LOG_BYTES = 4 << 20  # the tail of each log the launcher names, copied beside the system's log at stop
NAMED_LOG = re.compile(r"\blog:? (/\S+\.log)\b")  # the launcher's "log: PATH" / "log PATH" in its output
# STUB_SITE emptied: on the device it puts the Triton stub's numpy 1.26 first on any Python's path (device_run.sh)
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0", "STUB_SITE": ""}
# On a card of less memory (an 80-GB H100) vLLM 0.26's default --gpu-memory-utilization (0.92) left too little beside
# its KV pool for the 3-minute video's vision-tower step: its engine stopped on the warm-up's video with CUDA out of
# memory ("Tried to allocate 5.45 GiB ... 4.08 GiB is free"); with 0.7 it served the videos (2026-12-05,
# bench/results/peer/goodput-long-video-2026-12-05/). An H200 (139 GiB) keeps vLLM's default.
SMALL_GPU_GIB = 100.0
SMALL_GPU_VLLM = ("--gpu-memory-utilization", "0.7")


SCHEDULING_KEYS = ("orchestrator.decode_pace_ms", "orchestrator.slo_text_tbt_ms", "orchestrator.idle_budget_scale",
                   "orchestrator.burst_wait_ms", "encode_prefill.sms_while_decoding", "orchestrator.fewer_sms_kinds")


def h200_scheduling(model: PeerModel) -> list[str]:
    """``model``'s H200 deployment file's scheduling settings (decode pacing, text's TBT target that bounds it, the
    idle budgets' scale, the burst wait, the SMs of the steps beside text streams and which modalities' steps those
    are), as the launcher's ``--set`` items (read from the file, so the benchmark serves what it says; its budgets
    stay out: each family's defaults, ``models.py``). Raises ConfigError (``deploy_config``) for a file that cannot be
    read or checked."""
    config = DeployConfig.load(REPO_ROOT / "deploy" / model.deploy)
    return [item for item in config.set_items() if item.split("=", 1)[0] in SCHEDULING_KEYS]


def environment(extra: dict, pythonpath: str | None) -> dict:
    """This process's environment with ``extra`` set and ``pythonpath`` first on PYTHONPATH."""
    env = {**os.environ, **extra}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    return env


def gpu_memory_gib(gpu: int = 0) -> float | None:
    """GPU ``gpu``'s memory in GiB, as ``nvidia-smi`` reports it (``memory.total``); None without ``nvidia-smi`` or an
    answer it can read."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    done = subprocess.run([binary, f"--id={gpu}", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True)
    try:
        return float(done.stdout.strip()) / 1024
    except ValueError:
        return None


def command(system: str, checkpoint: Path, media: Path, smoke: bool, extra: list[str], caches: bool = False,
            model: PeerModel = MODELS[DEFAULT], gpu_gib: float | None = None) -> tuple[list[str], dict]:
    """(argv, extra environment) that start ``system`` on ``PORTS[system]`` serving ``model`` from ``checkpoint``
    (smoke: UnifiedServe's tiny default model); ``extra`` is appended to argv (so it may override what comes
    before); ``caches``: both systems' prefix caches on (their defaults; vLLM's processor cache too), else off, as
    the benchmark repeats the same media; ``gpu_gib`` (the GPU's memory, None: not known): vLLM takes
    :data:`SMALL_GPU_VLLM` below :data:`SMALL_GPU_GIB`. Raises ValueError for an unknown system."""
    port = str(PORTS[system])
    if system == "unifiedserve":
        ports = ServerPorts.unused()
        argv = [sys.executable, "-m", "backends.triton.launcher", "--openai-port", port, "--ready-timeout", "900",
                "--http-port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics)]
        if not smoke:  # the H200 deployment file's GPU sharing (docs/deployment.md, "Sharing a GPU") and scheduling
            argv += ["--model", str(checkpoint), "--set", "*.load_format=dummy", "--gpu-sharing", "mps"]
            argv += [a for item in (*model.unifiedserve, *h200_scheduling(model)) for a in ("--set", item)]
        if not caches:  # the encoder cache keeps vision outputs by media identity across requests
            argv += ["--set", "orchestrator.prefix_caching=false", "--set", "orchestrator.encoder_cache_tokens=0"]
        return argv + extra, {"UNIFIEDSERVE_MEDIA_DIRS": str(media)}
    if system == "vllm":
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
                "--load-format", "dummy", "--dtype", "bfloat16", "--allowed-local-media-path", str(media),
                *model.vllm, "--host", "127.0.0.1", "--port", port]
        if not caches:
            argv += ["--no-enable-prefix-caching", "--mm-processor-cache-gb", "0"]
        else:
            argv += ["--enable-prompt-tokens-details"]  # usage.prompt_tokens_details.cached_tokens, as ours
        if gpu_gib is not None and gpu_gib < SMALL_GPU_GIB:
            argv += SMALL_GPU_VLLM
        return argv + extra, VLLM_ENV
    raise ValueError(f"unknown system {system!r}; one of {SYSTEMS}")


def start(system: str, argv: list[str], env: dict, state: Path, log: Path, pythonpath: str | None,
          ready_timeout_s: float) -> dict:
    """Start ``argv`` in its own session, wait until its ``/v1/models`` answers, record and return its state
    (``pid``, ``url``, ``model``, ``log``). ``pythonpath`` goes first on its PYTHONPATH. Raises RuntimeError (with
    the log's tail) when it exits or is not ready in time; it is stopped then."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=environment(env, pythonpath),
                                   cwd=str(REPO_ROOT), start_new_session=True)
    record = {"system": system, "pid": process.pid, "url": f"http://127.0.0.1:{PORTS[system]}", "log": str(log),
              "argv": argv}
    state.mkdir(parents=True, exist_ok=True)
    (state / f"{system}.json").write_text(json.dumps(record, indent=1))
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            stop(system, state)
            raise RuntimeError(f"{system} exited with {process.returncode}:\n{log.read_text()[-5000:]}")
        try:
            with urllib.request.urlopen(f"{record['url']}/v1/models", timeout=5) as response:
                record["model"] = json.loads(response.read())["data"][0]["id"]
            (state / f"{system}.json").write_text(json.dumps(record, indent=1))
            return record
        except OSError:
            time.sleep(2)
    stop(system, state)
    raise RuntimeError(f"{system} not ready within {ready_timeout_s} s:\n{log.read_text()[-5000:]}")


def metrics_port(record: dict) -> int | None:
    """The Triton metrics port of a UnifiedServe server's ``record`` (from its command line); None for vLLM."""
    argv = record["argv"]
    return int(argv[argv.index("--metrics-port") + 1]) if "--metrics-port" in argv else None


def running(system: str, state: Path) -> dict:
    """The recorded state of ``system``'s server. Raises RuntimeError when none was started or it has ended."""
    path = state / f"{system}.json"
    if not path.exists():
        raise RuntimeError(f"no {system} server was started (no {path}): run the 'start' command first")
    record = json.loads(path.read_text())
    if not _alive(record["pid"]) or "model" not in record:
        raise RuntimeError(f"the {system} server (pid {record['pid']}) is not running; its log: {record['log']}")
    return record


def stop(system: str, state: Path) -> None:
    """Stop ``system``'s recorded server: SIGTERM to it (the launcher drains and stops tritonserver and the API;
    vLLM's server its engine), then SIGKILL to what is left of its session after ``STOP_TIMEOUT_S``; remove the
    record. Nothing to do when none is recorded."""
    path = state / f"{system}.json"
    if not path.exists():
        return
    record = json.loads(path.read_text())
    pid = record["pid"]
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _group_alive(pid):
            os.killpg(pid, signal.SIGKILL)  # its own session: the group id is its pid
    keep_named_logs(Path(record["log"]))
    path.unlink()


def keep_named_logs(log: Path) -> list[Path]:
    """Copy each file that ``log`` names as a log (the launcher's ``log: PATH`` and ``log PATH``), its last
    :data:`KEPT_LOG_BYTES` bytes, beside ``log`` as ``<log's stem>.<its name>``; the copies made. A named file that
    has gone is skipped."""
    kept = []
    text = log.read_text(errors="replace") if log.exists() else ""
    for named in dict.fromkeys(Path(p) for p in NAMED_LOG.findall(text)):
        if not named.is_file():
            continue
        copy = log.with_name(f"{log.stem}.{named.name}")
        with open(named, "rb") as source:
            source.seek(max(0, named.stat().st_size - KEPT_LOG_BYTES))
            copy.write_bytes(source.read())
        kept.append(copy)
    return kept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # the field after (comm)


def _group_alive(pgid: int) -> bool:
    try:
        os.waitpid(pgid, os.WNOHANG)  # reap the leader when this process started it (a zombie counts as alive)
    except ChildProcessError:
        pass
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
