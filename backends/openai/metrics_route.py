"""``GET /metrics`` on the API's port, where vLLM serves its Prometheus metrics: Triton's metrics text as read from
its metrics port (``--metrics-url``, which the launcher passes): UnifiedServe's ``unifiedserve_*`` metrics (vLLM's
``vllm:*`` under this prefix, docs/metrics.md) and Triton's own ``nv_*``, so that one scrape target serves both
ports' users. Open without an API key, as vLLM leaves it (``api_keys.PUBLIC_PATHS``)."""
from __future__ import annotations

import httpx
from fastapi import APIRouter, Request, Response

from backends.openai.errors import ApiError

router = APIRouter()
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text exposition format


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """The metrics text, fetched now (within ``replica_health.FETCH_TIMEOUT_S`` seconds). Raises ApiError: 404
    when the API has no metrics URL (started alone without ``--metrics-url``), 502 when Triton's metrics cannot be
    read."""
    replicas = request.app.state.api.replicas
    if replicas is None:
        raise ApiError(404, "/metrics: this API was started without --metrics-url (Triton's metrics port), which "
                            "the launcher passes")
    try:
        return Response(await replicas.text(), media_type=CONTENT_TYPE)
    except httpx.HTTPError as exc:
        raise ApiError(502, f"/metrics: Triton's metrics at {replicas.url} cannot be read ({exc!r})") from None
