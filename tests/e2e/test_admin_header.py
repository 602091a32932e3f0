"""--admin-header: only requests carrying it may change the server's log and trace settings or register shared memory
(Triton's restricted APIs, HTTP and gRPC, where its metadata key is "triton-grpc-protocol-" + the name); inference,
health and metadata stay open. Without it no client may register shared memory (a region could be any of /dev/shm's,
the server's own)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from client.api import Client
from tests.e2e.conftest import serve

pytestmark = pytest.mark.e2e
HEADER = ("x-unifiedserve-admin", "s3cret")


def _status(url: str, headers: dict[str, str], body: dict | None = None) -> int:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_log_and_trace_settings_need_the_header_and_inference_does_not(media_dir):
    with serve(media_dir, admin_header=HEADER) as srv:
        http = f"http://127.0.0.1:{srv.ports.http}"
        verbose = {"log_verbose_level": 1}
        assert _status(f"{http}/v2/logging", {}, verbose) == 403
        assert _status(f"{http}/v2/logging", {"X-UnifiedServe-Admin": "wrong"}, verbose) == 403
        assert _status(f"{http}/v2/trace/setting", {}) == 403
        assert _status(f"{http}/v2/logging", {"X-UnifiedServe-Admin": "s3cret"}, {"log_verbose_level": 0}) == 200
        assert _status(f"{http}/v2/health/ready", {}) == 200
        assert _status(f"{http}/v2/models/orchestrator", {}) == 200
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.ports.grpc}")
        with pytest.raises(InferenceServerException):
            grpc.update_log_settings(verbose)
        with pytest.raises(InferenceServerException, match="triton-grpc-protocol-x-unifiedserve-admin"):
            grpc.update_log_settings({"log_verbose_level": 0}, headers=dict([HEADER]))
        # Triton's rule: over gRPC the metadata key is the header's name after "triton-grpc-protocol-"
        grpc.update_log_settings({"log_verbose_level": 0},
                                 headers={"triton-grpc-protocol-x-unifiedserve-admin": "s3cret"})
        region = shm.create_shared_memory_region("probe", "/unifiedserve-test-probe", 64)
        try:
            with pytest.raises(InferenceServerException, match="restricted"):
                grpc.register_system_shared_memory("probe", "/unifiedserve-test-probe", 64)
            grpc.register_system_shared_memory("probe", "/unifiedserve-test-probe", 64,
                                               headers={"triton-grpc-protocol-x-unifiedserve-admin": "s3cret"})
            grpc.unregister_system_shared_memory("probe",
                                                 headers={"triton-grpc-protocol-x-unifiedserve-admin": "s3cret"})
        finally:
            shm.destroy_shared_memory_region(region)
        with Client(f"127.0.0.1:{srv.ports.grpc}") as client:
            assert client.generate("Hi", sampling={"max_tokens": 2, "ignore_eos": True}).num_output_tokens == 2


def test_without_the_header_no_client_may_register_shared_memory(server):
    """The server's /dev/shm regions (its pools, the Python backend's with every request's tensors) are not for a
    client to map: Triton 2.51 would register any of them by name."""
    pools = sorted(p.name for p in Path("/dev/shm").glob("unifiedserve-*"))
    assert pools, "the server's pools are in /dev/shm"
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    with pytest.raises(InferenceServerException, match="restricted"):
        grpc.register_system_shared_memory("pool", "/" + pools[0], 8)
    http = f"http://127.0.0.1:{server.ports.http}"
    body = {"key": "/" + pools[0], "offset": 0, "byte_size": 8}
    assert _status(f"{http}/v2/systemsharedmemory/region/pool/register", {}, body) == 403
