"""Whether any of the orchestrator's replicas still serves, read from Triton's Prometheus metrics, for ``/health``.

The orchestrator sets the gauge ``unifiedserve_replica_serving{replica="N"}`` (``orchestrator/gauges.py``; a
number, no unit) to 1 while replica N serves and to 0 once its decode stream or its step loop has ended. With every
replica ended each generation request fails (500), yet Triton keeps the orchestrator model READY, so readiness alone
would keep ``/health`` at 200 and a load balancer sending traffic to a server that cannot answer (vLLM's ``/health``
fails once its engine is dead). :class:`ReplicaHealth` fetches Triton's metrics text (``--metrics-url``, within
``FETCH_TIMEOUT_S`` seconds) and :func:`replicas_serving` reads the gauge's samples from it.
"""
from __future__ import annotations

import logging
import math
import re

import httpx

from orchestrator.metrics import SERVING

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 2.0  # seconds for the whole fetch (a load balancer's check waits on it)
# a sample line: the name, its labels if any (to the line's last "}"), then the value (a timestamp may follow)
_SAMPLE = re.compile(rf"^{SERVING}(?:\{{[^\n]*\}})?[ \t]+(\S+)", re.MULTILINE)


def replicas_serving(text: str) -> bool | None:
    """Whether a replica serves by the Prometheus text exposition ``text``: True when some
    ``unifiedserve_replica_serving`` sample is not 0, False when every one is 0, None when there is none. Comments
    (``# HELP``, ``# TYPE``), other metrics (those whose names only begin with it too), and samples whose value is not
    a number (or is NaN) are ignored."""
    values = []
    for match in _SAMPLE.finditer(text):
        try:
            value = float(match.group(1))
        except ValueError:
            continue
        if not math.isnan(value):
            values.append(value)
    return any(values) if values else None


class ReplicaHealth:
    """Reads ``url`` (Triton's metrics endpoint, e.g. ``http://127.0.0.1:8002/metrics``) for :func:`replicas_serving`;
    one per API process, which logs at most one warning about it (not one per health check)."""

    def __init__(self, url: str, timeout_s: float = FETCH_TIMEOUT_S):
        self.url = url
        # the endpoint is the server's own: no proxy from the environment
        self._client = httpx.AsyncClient(timeout=timeout_s, trust_env=False)
        self._warned = False

    async def text(self) -> str:
        """The metrics text fetched now (Prometheus' text exposition). Raises httpx.HTTPError when it cannot be
        fetched: no connection, a timeout, a status other than 2xx."""
        response = await self._client.get(self.url)
        response.raise_for_status()
        return response.text

    async def serving(self) -> bool | None:
        """:func:`replicas_serving` of the metrics fetched now; None when they cannot be fetched (no connection, a
        timeout, a status other than 2xx) or hold no such sample. Raises nothing."""
        try:
            text = await self.text()
        except httpx.HTTPError as exc:
            self._warn(f"cannot read Triton's metrics at {self.url} ({exc!r})")
            return None
        serving = replicas_serving(text)
        if serving is None:
            self._warn(f"Triton's metrics at {self.url} list no {SERVING}")
        return serving

    def _warn(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s: /health answers by tritonserver's readiness alone meanwhile (said once per process)", what)

    async def close(self) -> None:
        await self._client.aclose()
