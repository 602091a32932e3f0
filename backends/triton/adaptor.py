"""The one body of every ``model_repository/<model>/1/model.py``: a Triton Python model that hands
``initialize``, ``execute`` and ``finalize`` to a class of ours, chosen by the model's name, so the model files
hold no logic.

The class is imported in ``initialize`` (the stub imports ``model.py`` before it knows which model it serves) and
built from Triton's ``args``; it has ``execute(requests)`` (a list of responses, or None for a decoupled model)
and ``finalize()``. A stage replica's model (``decode_r1``, ``backends.triton.replicas``) is its stage's class.
Before the class is built, our packages' log lines are tagged with the model's name (``model_log``) and, for a
server started without the launcher, the run directory is found (``standalone``); it is let go of last. Once it is
built, the heap is collected and frozen (``backends.gc_heap``, as vLLM's engine core and SGLang's scheduler do after
start-up): the model's modules, weights' wrappers and tokenizer are never walked again by a full collection, which
would otherwise pause a step for as long as the walk takes (about a second for a stage's heap at exit:
``server_stop.before_exit``); long collections are logged, and a stage's heap is frozen again after a long full one
(what its compiled graphs made after start-up; not the orchestrator's, whose requests' state forms cycles). Every
model's ``gil_switch_interval_ms`` (empty: Python's 5 ms) is its process's ``sys.setswitchinterval``: the longest a
thread that wants the GIL waits while another thread computes (the orchestrator's Triton thread, event loop and send
lanes, a stage's step and send threads). A stage's ``finalize`` first lets the orchestrator drain
(``server_stop.drain_before_unload``: a plain tritonserver unloads every model at once when signalled). A model whose
tritonserver dies without unloading it is ended by a watchdog (``parent_watch``). A model's instance holds a lock in the
run directory while it serves (:func:`serving_lock`), so that Triton's reload of a loaded model with a new
configuration, which starts the new instance beside the old one, is refused instead of running two.
"""
from __future__ import annotations

import fcntl
import importlib
import json
import os
import re
import sys
import time
from pathlib import Path

from backends.gc_heap import freeze_startup_heap, watch_collections
from backends.ipc.run_dir import run_dir
from backends.triton import model_log, parent_watch, server_stop, standalone, triton_io
from backends.triton.repository import model_wide_conflicts

MODELS = {
    "orchestrator": "orchestrator.triton_model:OrchestratorModel",
    "flashcodec": "backends.stages.flashcodec_stage:FlashCodecStage",
    "encode_prefill": "backends.stages.encode_prefill_stage:EncodePrefillStage",
    "decode": "backends.stages.decode_stage:DecodeStage",
}


def model_class(model_name: str) -> type:
    """The class serving Triton model ``model_name``; raises KeyError for a model that is not ours."""
    module_name, class_name = MODELS[_base_name(model_name)].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def _base_name(model_name: str) -> str:
    """The stage's name of a replica's model (``decode_r1``: ``decode``); other names as they are."""
    return re.sub(r"_r\d+$", "", model_name)


def one_instance(args: dict) -> None:
    """Raise ValueError when the model's ``instance_group`` asks for more than one instance: each of our models holds
    state one process must own (the orchestrator its page tables and the stages' links, a stage its link's socket),
    so a second decode instance fails on its socket ("Address already in use") and a second orchestrator's requests
    find the decode stream taken (a fresh Triton admin's try, 2026-12-06). More throughput is more replicas:
    ``orchestrator.replicas`` (docs/deployment.md)."""
    groups = json.loads(args.get("model_config") or "{}").get("instance_group") or []
    count = sum(int(group.get("count", 1)) for group in groups)
    if count > 1:
        raise ValueError(f"{args['model_name']}: instance_group asks for {count} instances; each of UnifiedServe's "
                         "models runs as one instance (count: 1): add replicas with --set orchestrator.replicas=N")


def one_served_model(args: dict) -> None:
    """Raise ValueError when the models of this model's repository (``args["model_repository"]``: the model's folder,
    in its repository's) set a key of the served model differently (``repository.model_wide_conflicts``: a
    repository edited by hand; the launcher's ``--set`` sets every model)."""
    folder = args.get("model_repository")
    repository = Path(folder).parent if folder else None
    conflicts = model_wide_conflicts(repository) if repository is not None and repository.is_dir() else []
    if conflicts:
        raise ValueError(f"{args['model_name']}: the models of {repository} must serve one model, but they set "
                         f"{'; '.join(conflicts)}: give every model the same value (the launcher's --set "
                         "MODEL.KEY=VALUE sets all of them)")


SERVING_LOCK_WAIT_S = 30.0  # how long a model's new instance waits for its old one to let go (unloaded just before)


def serving_lock(model_name: str, wait_s: float = SERVING_LOCK_WAIT_S) -> int:
    """Take model ``model_name``'s lock in the run directory (``<model>.serving``, a POSIX record lock: a process
    this one starts later does not hold it, and it goes with this process) and return its file descriptor, which
    holds it until closed. Waits up to ``wait_s`` seconds for another process holding it to let go (an unload
    returns before the old instance has finished, and a load may follow at once); raises ValueError when it still
    holds it: an instance of the model serves in this server. Triton's load of a loaded model with a new
    configuration (``parameters.config`` of ``/v2/repository/models/<model>/load``) starts the new instance while
    the old one serves; two orchestrators (or two of a stage) would share the stages' links and pools, and
    tritonserver aborted ("malloc(): unaligned fastbin chunk detected") after requests hung (a fresh Triton user's
    test, 2026-12-07). Refused, the reload fails and Triton keeps the old instance serving (its documented rule for
    a reload that fails)."""
    fd = os.open(run_dir() / f"{model_name}.serving", os.O_CREAT | os.O_RDWR, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError:
            if time.monotonic() < deadline:
                time.sleep(0.1)
                continue
        os.close(fd)
        raise ValueError(f"{model_name}: another instance of this model still runs in this server after {wait_s:g} "
                         "s (two cannot share the stages' links and pools): a load with a new configuration while "
                         "the model is loaded (Triton starts the new instance beside the old one, which serves on), "
                         "or an unload whose requests have not ended yet; unload the model (a stage: every model), "
                         "wait until it is unloaded, then load it") from None


class TritonPythonModel:
    def initialize(self, args):
        model_log.install(args["model_name"])
        one_instance(args)
        one_served_model(args)
        interval_ms = triton_io.float_parameter(triton_io.parameters(args), "gil_switch_interval_ms")
        if interval_ms is not None:  # before anything exists that a refused value would leave behind
            sys.setswitchinterval(interval_ms / 1e3)
        parent_watch.watch()  # before the server's lock is taken, which the watchdog would hold too
        self.run_dir = standalone.adopt()
        self.model_name = args["model_name"]
        self.stage = _base_name(self.model_name) != "orchestrator"
        self.lock = None
        try:
            self.lock = serving_lock(self.model_name)
            self.model = model_class(self.model_name)(args)
        except BaseException:  # Triton will not call finalize()
            self._let_go()
            raise
        freeze_startup_heap()
        watch_collections(args["model_name"], refreeze=self.stage)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        try:
            if self.stage:  # the orchestrator's requests end before the stage's link does (server_stop)
                server_stop.drain_before_unload(self.model_name)
            self.model.finalize()
        finally:
            self._let_go()

    def _let_go(self) -> None:
        """The serving lock, then the run directory (a server's without the launcher)."""
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None
        if self.run_dir is not None:
            self.run_dir.release()
