"""Names of the stage replicas: replica k of the encode+prefill and decode stages, with its own KV pool.

Replica 0 is the repository's own ``encode_prefill`` and ``decode`` with the pool ``kv_pool``; replica k >= 1 is
``encode_prefill_r<k>`` / ``decode_r<k>`` with ``kv_pool_r<k>``, copies the launcher writes into the repository
it serves (``backends.triton.repository.repository_with``, orchestrator parameter ``replicas``). Each replica runs on
GPU ``k mod GPUs`` under ``device: auto`` (``backends.stages.device.stage_device``), and the orchestrator sends
each request to one replica (``orchestrator.routing``). Each replica's stages have their own link sockets,
named after their models, hence models rather than instance groups.
"""
from __future__ import annotations

REPLICATED_STAGES = ("encode_prefill", "decode")


def replica_name(base: str, replica: int) -> str:
    """``base`` for replica 0, ``<base>_r<replica>`` for the others (model or shared-pool name)."""
    if replica < 0:
        raise ValueError(f"replica must be >= 0, got {replica}")
    return base if replica == 0 else f"{base}_r{replica}"
