"""Triton 2.51's gRPC race that keeps a decoupled model from unloading, without any UnifiedServe code.

    python bench/grpc_cancel_race.py [--tries 6] [--streams 200] [--burners 2] [--delay 0] [--verbose] [--port 28150]

Serves one bare decoupled Python model (``echo9``: 8 responses 5 ms apart, then a final one, from a thread) on the
tritonserver UnifiedServe runs (``server_binary``), sends ``--streams`` gRPC streams at once (each ``start_stream``,
one request, its final response read, then ``stop_stream(cancel_requests=True)`` after ``--delay`` seconds), stops
the server with SIGINT and times its exit, ``--tries`` times. ``--burners`` busy processes load the CPU as a
UnifiedServe server's other processes do. A stop that takes Triton's exit timeout (10 s, status 1) has a gRPC
stream state that took the client's cancel for a request in flight after its final write (docs/operations.md,
"Stopping", step 3); with ``--verbose`` (log verbosity 1) each try counts those states ("Waiting for the callback
to retrieve cancellation"), none in a prompt stop. On the 2-core CPU machine (2026-12-07, ``--verbose``, two
burners): 2 stops of 6 took 10.5-10.6 s, with 2 and 1 such states; the other 4 took 2.3-2.5 s, with none.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backends.triton.server_binary import server_binary  # noqa: E402

CONFIG = """name: "echo9"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

MODEL = """import threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.answer, args=(request.get_response_sender(),), daemon=True).start()
        return None

    def answer(self, sender):
        time.sleep(0.08)
        for k in range(9):
            out = pb_utils.Tensor("text_output", np.array([b"x" * 8], dtype=np.object_))
            final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if k == 8 else 0
            sender.send(pb_utils.InferenceResponse([out]), flags=final)
            time.sleep(0.005)
"""


def burn() -> None:
    while True:
        pass


def streams(url: str, count: int, delay_s: float) -> list[str]:
    import tritonclient.grpc as grpcclient
    errors: list[str] = []

    def one() -> None:
        try:
            answers, client = queue.Queue(), grpcclient.InferenceServerClient(url)
            client.start_stream(callback=lambda result, error: answers.put(error or result))
            text = grpcclient.InferInput("text_input", [1], "BYTES")
            text.set_data_from_numpy(np.array([b"hi"], dtype=object))
            client.async_stream_infer("echo9", [text], enable_empty_final_response=True)
            while True:
                answer = answers.get(timeout=60)
                if isinstance(answer, Exception):
                    errors.append(str(answer))
                    break
                if answer.get_response().parameters["triton_final_response"].bool_param:
                    break
            time.sleep(delay_s)
            client.stop_stream(cancel_requests=True)
            client.close()
        except Exception as exc:  # noqa: BLE001 - counted and shown
            errors.append(repr(exc))

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def one_try(repository: Path, log: Path, args) -> str:
    binary, backends, env = server_binary()
    command = [str(binary), f"--model-repository={repository}", f"--backend-directory={backends}",
               f"--http-port={args.port}", f"--grpc-port={args.port + 1}", f"--metrics-port={args.port + 2}",
               "--exit-timeout-secs=10", *(["--log-verbose=1"] if args.verbose else [])]
    with open(log, "wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/v2/health/ready", timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.burners)]
        for burner in burners:
            burner.start()
        errors = streams(f"127.0.0.1:{args.port + 1}", args.streams, args.delay)
        time.sleep(1)
        t0 = time.monotonic()
        server.send_signal(signal.SIGINT)
        status = server.wait(timeout=60)
        took = time.monotonic() - t0
        for burner in burners:
            burner.terminate()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    text = log.read_text(errors="replace")
    stuck = text.count("Waiting for the callback to retrieve cancellation")
    return (f"stop {took:.1f} s, status {status}, errors {len(errors)}"
            + (f", states waiting for a callback that already came: {stuck}" if args.verbose else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tries", type=int, default=6)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds between the final response and the cancel")
    parser.add_argument("--verbose", action="store_true", help="log verbosity 1, and count the stuck states")
    parser.add_argument("--port", type=int, default=28150, help="HTTP port; gRPC and metrics take the next two")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="grpc-cancel-race-") as folder:
        repository = Path(folder) / "models"
        (repository / "echo9" / "1").mkdir(parents=True)
        (repository / "echo9" / "config.pbtxt").write_text(CONFIG)
        (repository / "echo9" / "1" / "model.py").write_text(MODEL)
        for k in range(args.tries):
            print(f"try {k + 1}: {one_try(repository, Path(folder) / f'server{k}.log', args)}", flush=True)


if __name__ == "__main__":
    main()
