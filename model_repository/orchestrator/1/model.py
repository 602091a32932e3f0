"""Triton adaptor for the orchestrator (orchestrator/service.py, orchestrator/frontend.py).

Decoupled, one instance, ``async def execute``: each request becomes a task on the stub's event loop,
so execute() returns at once and many requests are served concurrently.
"""
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root; the stub ignores PYTHONPATH


class TritonPythonModel:
    def initialize(self, args):
        from backends import triton_io
        from orchestrator import frontend
        from orchestrator.metrics import Metrics
        from orchestrator.service import Orchestrator, OrchestratorConfig

        self.frontend = frontend
        config = OrchestratorConfig.from_parameters(triton_io.parameters(args))
        self.orchestrator = Orchestrator(config, Metrics())
        self.tasks = set()

    async def execute(self, requests):
        loop = asyncio.get_running_loop()
        for request in requests:
            task = loop.create_task(self.frontend.handle(self.orchestrator, request))
            self.tasks.add(task)  # keep a reference until done
            task.add_done_callback(self.tasks.discard)
        return None
