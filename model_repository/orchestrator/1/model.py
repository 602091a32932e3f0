"""Triton adaptor for the orchestrator (orchestrator/service.py, orchestrator/frontend.py).

Decoupled, one instance, ``async def execute``: the stub runs each execute() as its own coroutine on
its event loop, so many requests are served concurrently while each coroutine lasts its requests'
lifetime. (Returning at once would trip a race in the 2.51 stub's bookkeeping of background futures,
triton-inference-server/server#8537, logged as "Cannot remove future from background".)
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

    async def execute(self, requests):
        await asyncio.gather(*(self.frontend.handle(self.orchestrator, request) for request in requests))
        return None
