"""What a custom-metric update costs in tritonserver's Python backend: the reason histograms are sent as counters
(``backends/triton/histograms.py``).

A throwaway model's ``initialize`` (in a real tritonserver, through ``backends.triton.server_binary``) times, per
call: ``observe()`` on a ``MetricFamily.HISTOGRAM`` series and ``increment()`` on a counter, with the stub
otherwise idle; then how many ``observe()`` calls a second thread makes while the model's main thread runs Python
(as the orchestrator's event loop does under load): the stub lets go of the GIL during each round trip and must
take it back after; and the same with the roles swapped. Writes ``<out>/metric_cost.json``.

Usage: ``python bench/metric_cost_probe.py --out DIR``
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backends.triton.ports import ServerPorts  # noqa: E402
from backends.triton.server_binary import server_binary  # noqa: E402
from bench.common import header, write  # noqa: E402

CALLS = 3000
CONTENDED_S = 1.0
CONFIG = """name: "probe"
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [1] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [1] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
MODEL = """import json, os, threading, time
import triton_python_backend_utils as pb


def per_call_us(call, n):
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n * 1e6


def contended(observe, seconds, observe_on_main):
    # observe() calls per second on one thread while another runs Python without a pause
    calls, stop = [0], threading.Event()

    def observer():
        while not stop.is_set():
            observe(0.05)
            calls[0] += 1

    def busy():
        while not stop.is_set():
            sum(range(100))

    thread = threading.Thread(target=busy if observe_on_main else observer)
    thread.start()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    (observer if observe_on_main else busy)()
    thread.join()
    return calls[0] / seconds


class TritonPythonModel:
    def initialize(self, args):
        histogram = pb.MetricFamily("probe_seconds", "probe", pb.MetricFamily.HISTOGRAM)
        counter = pb.MetricFamily("probe_total", "probe", pb.MetricFamily.COUNTER)
        self.families = [histogram, counter]
        self.metrics = [histogram.Metric(labels={}, buckets=[0.01, 0.1, 1.0]), counter.Metric(labels={})]
        observe, increment = self.metrics[0].observe, self.metrics[1].increment
        n, seconds = int(os.environ["PROBE_CALLS"]), float(os.environ["PROBE_CONTENDED_S"])
        found = {"observe_us_idle": per_call_us(lambda: observe(0.05), n),
                 "increment_us_idle": per_call_us(lambda: increment(1), n)}
        found["observe_per_s_thread_beside_busy_main"] = contended(observe, seconds, observe_on_main=False)
        found["observe_per_s_main_beside_busy_thread"] = contended(observe, seconds, observe_on_main=True)
        with open(os.environ["PROBE_OUT"], "w") as f:
            json.dump(found, f)

    def execute(self, requests):
        return [pb.InferenceResponse([pb.Tensor("y", pb.get_input_tensor_by_name(r, "x").as_numpy())])
                for r in requests]

    def finalize(self):
        self.metrics = []  # before their families (triton-inference-server/server#8662)
        self.families = []
"""


def probe(timeout_s: float = 300.0) -> dict:
    """Start a tritonserver with the probe model, wait for its figures, stop it; raises RuntimeError with the log's
    tail when the server exits or no figures come within ``timeout_s`` seconds."""
    binary, backends, env = server_binary()
    ports = ServerPorts.unused()
    with tempfile.TemporaryDirectory(prefix="metric-cost-") as tmp:
        model = Path(tmp, "repo", "probe")
        (model / "1").mkdir(parents=True)
        (model / "config.pbtxt").write_text(CONFIG)
        (model / "1" / "model.py").write_text(MODEL)
        out, log = Path(tmp, "out.json"), Path(tmp, "server.log")
        server_env = {**os.environ, **env, "PROBE_OUT": str(out), "PROBE_CALLS": str(CALLS),
                      "PROBE_CONTENDED_S": str(CONTENDED_S)}
        with open(log, "w") as log_file:
            server = subprocess.Popen(
                [str(binary), f"--model-repository={model.parent}", f"--backend-directory={backends}",
                 f"--http-port={ports.http}", f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}",
                 "--http-address=127.0.0.1", "--grpc-address=127.0.0.1"],
                env=server_env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout_s
            while not _ready(ports):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the probe server did not come up:\n{log.read_text()[-4000:]}")
                time.sleep(0.5)
            return json.loads(out.read_text())
        finally:
            server.send_signal(2)
            server.wait(timeout=60)


def _ready(ports: ServerPorts) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{ports.http}/v2/health/ready", timeout=2).status == 200
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for metric_cost.json")
    args = parser.parse_args()
    results = {**header(torch.device("cpu")), "calls": CALLS, "contended_s": CONTENDED_S, **probe()}
    print(json.dumps(results, indent=1))
    write(Path(args.out), "metric_cost", results)


if __name__ == "__main__":
    main()
