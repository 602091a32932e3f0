"""Triton adaptor for the orchestrator (orchestrator/service.py, orchestrator/frontend.py).

Decoupled, one instance. Its asyncio loop runs in a thread of its own (as Triton's vLLM backend
does): execute() hands each request to that loop and returns at once, so many requests are served
concurrently and execute() never blocks. (The stub's own `async def execute` path was tried and
dropped: its bookkeeping of background futures races when a coroutine ends quickly,
triton-inference-server/server#8537.)
"""
import asyncio
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root; the stub ignores PYTHONPATH


class TritonPythonModel:
    def initialize(self, args):
        from backends import triton_io
        from orchestrator import frontend
        from orchestrator.metrics import Metrics
        from orchestrator.service import Orchestrator, OrchestratorConfig

        self.frontend = frontend
        triton_io.enable_stack_dumps()
        config = OrchestratorConfig.from_parameters(triton_io.parameters(args))
        self.orchestrator = Orchestrator(config, Metrics())
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="orchestrator-loop", daemon=True)
        self.thread.start()
        self.pending = set()  # futures of requests in flight (asyncio keeps only weak references to tasks)

    def execute(self, requests):
        for request in requests:
            future = asyncio.run_coroutine_threadsafe(self.frontend.handle(self.orchestrator, request), self.loop)
            self.pending.add(future)
            future.add_done_callback(self.pending.discard)
        return None

    def finalize(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
