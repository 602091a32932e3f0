"""The orchestrator as a Triton model (``backends.triton.adaptor``): decoupled, one instance.

Its asyncio loop runs in a thread of its own (as Triton's vLLM backend does): ``execute()`` hands each request to
that loop and returns at once, so many requests are served concurrently and ``execute()`` never blocks
(docs/design.md, invariant 1). The stub's own ``async def execute`` is not used: in 2.51 its bookkeeping of background
futures races when a coroutine ends quickly (triton-inference-server/server#8537). When the server stops, the
stop watch (``backends.triton.server_stop``) fails the requests in flight, so that every client stream gets its
final flag (Triton calls ``finalize()`` only after that), and says when no request or stage call is left.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

from backends.triton import server_stop, triton_io
from orchestrator import frontend
from orchestrator.cancel_watch import CancelWatch
from orchestrator.metrics import Metrics
from orchestrator.send_lanes import SendLanes
from orchestrator.config import OrchestratorConfig
from orchestrator.service import Orchestrator
from orchestrator.token_channels import MAX_OPEN, TokenChannels

log = logging.getLogger(__name__)


START_RETRY_S = 1.0  # between the tries of the start at load


async def start_at_load(orchestrator: Orchestrator) -> None:
    """Start ``orchestrator``'s engines now, not at the first request, so that it does not wait for them and the KV
    and patch gauges show the pools: tried until it succeeds (each try waits for the stages' pools and links, which
    may load for minutes, as ``Orchestrator.ensure_started`` does for a request) or the orchestrator stops."""
    tries = 0
    while not orchestrator.stopping:
        tries += 1
        try:
            await orchestrator.ensure_started()
        except Exception as exc:  # noqa: BLE001 - a stage not loaded yet (or not at all: model control)
            log.debug("orchestrator: start at load, try %d: %s", tries, exc)
            await asyncio.sleep(START_RETRY_S)
            continue
        log.info("orchestrator: engines started and stage links connected (try %d)", tries)
        return


class OrchestratorModel:
    def __init__(self, args: dict):
        triton_io.enable_stack_dumps()
        params = triton_io.parameters(args)
        config = OrchestratorConfig.from_parameters(params)
        generation = config.generation
        if generation.sampling or generation.max_new_tokens:  # as vLLM says it at start
            log.info("defaults from the checkpoint's generation_config.json: sampling %s, max_new_tokens %s (a "
                     "request's own values win; parameter generation_config=none for the built-in defaults)",
                     dict(generation.sampling), generation.max_new_tokens)
        self.metrics = Metrics(config.replicas)
        self.lanes = SendLanes(triton_io.int_parameter(params, "send_lanes", 4))  # threads sending client responses
        self.cancels = CancelWatch()  # the thread asking whether clients have cancelled
        self.orchestrator = Orchestrator(config, self.metrics)
        # streams carrying many requests' replies (orchestrator.token_channels)
        self.channels = TokenChannels(triton_io.int_parameter(params, "max_token_channels", MAX_OPEN))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="orchestrator-loop", daemon=True)
        self.thread.start()
        self.pending = set()  # futures of requests in flight (asyncio keeps only weak references to tasks)
        server_stop.serving_again()  # loaded again alone: its last finalize's mark is not this one's
        self.watch = server_stop.StopWatch(lambda: self.loop.call_soon_threadsafe(self._stop_serving))
        self.starting = asyncio.run_coroutine_threadsafe(start_at_load(self.orchestrator), self.loop)

    def execute(self, requests):
        arrived = time.monotonic()  # latencies count from here: the loop may pick a request up later
        self.orchestrator.note_arrivals(len(requests))  # each handler ends its admission (admission_ended)
        for request in requests:
            handling = frontend.handle(self.orchestrator, request, self.lanes, self.cancels, self.channels, arrived)
            future = asyncio.run_coroutine_threadsafe(handling, self.loop)
            self.pending.add(future)
            future.add_done_callback(self.pending.discard)
        return None

    def _stop_serving(self) -> None:  # on the loop
        why = server_stop.why_stopping()
        self.channels.close_all(why)
        if why:  # a stage's finalize announced it: the server may go on serving nothing
            log.warning("orchestrator: serving stopped: %s", why)
        self.orchestrator.stop_serving(server_stop.mark_drained, why)

    def finalize(self):
        # Every client stream has its final flag (else Triton would not call this); nothing may touch Triton
        # objects once this returns. Each wait is bounded: after a drained stop (launcher) none of them waits.
        self.watch.close()
        self.starting.cancel()
        concurrent.futures.wait(list(self.pending), timeout=5)  # handlers finishing after their final flag
        self.lanes.close()  # their responses sent
        self.cancels.close()
        try:
            asyncio.run_coroutine_threadsafe(self.orchestrator.close(timeout_s=5), self.loop).result(timeout=10)
        except Exception as exc:
            log.warning("orchestrator: close failed: %r", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.metrics.close()
        server_stop.mark_drained()  # nothing of this model's is in flight: a stage unloading after it need not wait
        server_stop.before_exit()
