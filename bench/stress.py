"""Stress (a reproduction and leak checks, not a speed figure): bursts of streams, a long soak, large uploads.

    python bench/stress.py burst --out DIR [--bursts 50] [--requests 200] [--bursts-per-server 10] [--timeout-s 600]
    python bench/stress.py soak --out DIR [--requests 10000] [--concurrency 32] [--warmup 1000] [--sample-s 10]
    python bench/stress.py payload --out DIR [--rounds 3] [--requests 4] [--images 4] [--side 1500] [--glibc-heap]

All serve the default (tiny) model (``--set MODEL.KEY=VALUE``: a parameter changed, e.g.
``orchestrator.replicas=2``) with a real tritonserver on free ports (``TritonServer``) and send streamed
gRPC requests with ``client.api.Client``, mixed as ``bench/stress_parts.py`` says: 75% text, 20% with a 64x64 PNG,
5% with a 16-frame video, 16 tokens each (``ignore_eos``); one in five cancelled after 1 to 3 responses; each with
a client timeout (``--timeout-s``).

``burst``: a bounded repro loop for a crash under bursts. A fresh server every ``--bursts-per-server`` bursts; each
burst is ``--requests`` requests at once. Per burst: its seconds, the requests completed and cancelled, the errors
(any request that failed other than by its own cancel; an ``overloaded`` refusal counts), and whether the server is
still whole (``fault``: tritonserver exited, with its signal; a stub gone; ``Signal (``, ``Segmentation fault`` or
``Fatal Python error`` in its log). It stops at the first fault (or a burst in which every request failed: a wedge;
or a fresh server that did not start), first asking the stubs still alive for their threads' stacks (faulthandler,
into the log), and keeps the log's tail as ``<out>/server-log-tail.txt``.

``soak``: ``--requests`` requests at ``--concurrency`` at a time on one server. Once ``--warmup`` requests have
ended, every ``--sample-s`` seconds it samples the resident memory (MB, /proc: ``rss``, and its parts ``anon`` and
``shmem`` as in ``payload``) of tritonserver and of each model's stub process. At the end it waits for idle, reads
the free-page gauges (``unifiedserve_kv_pages_free`` / ``_total``, ``unifiedserve_patch_pages_free`` / ``_total``)
and takes an idle sample. RSS growth per process is
the last sample under load against the first after warm-up (``growth``), and the idle sample against that first
(``idle_growth``); a growth of ``--max-growth`` (0.05) or more fails.

``payload``: memory left after large uploads. A round is ``--requests`` requests at once, each with ``--images``
random-noise PNGs of ``--side`` x ``--side`` pixels (1500: 6.75 MB each), seen at 100,000 pixels (little model
work); round -1 is text alone. After each round, once the pools are idle, it samples each process's memory
(``rss`` and its parts ``anon``, the process's own heap, and ``shmem``, shared memory touched, such as the Python
backend's region). ``--glibc-heap`` serves without the launcher's fixed mmap threshold (``HEAP_ENV``), to
compare.

Every mode writes ``<out>/stress.json`` (device, date, versions; the arguments; the record) after every burst, sample or
round, so a partial record survives a crash of the script itself. A server's log is ``<out>/server-K.log`` (burst: the
K-th server) or ``<out>/server.log`` while it runs; it is removed after a clean stop and kept when the stop
went wrong (``stop`` in the JSON says what).

Exit status: 0 all held; 1 a check failed (a request errored, a page was not free at the end, RSS grew by
``--max-growth`` or more); 2 tritonserver or a stub crashed or the server wedged (see ``fault`` in the JSON).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backends.triton.launcher import REPO_ROOT, TritonServer  # noqa: E402
from backends.triton.ports import ServerPorts  # noqa: E402
from backends.triton.repository import parse_overrides, repository_with  # noqa: E402
from bench.common import header, write  # noqa: E402
from bench.stress_parts import (Media, at_once, fault, growth, keep_log_tail, run_request,  # noqa: E402
                                server_memory_mb, since)
from client.api import Client, ServerError  # noqa: E402
from tests.e2e.conftest import wait_for_idle_pools  # noqa: E402

CRASHED, FAILED = 2, 1  # exit statuses
ERRORS_KEPT = 20  # error messages kept per burst (and for the soak); the count is always whole


class Record:
    """The JSON record of one run, written to ``<out>/stress.json`` on every :meth:`save`."""

    def __init__(self, out: Path, args: argparse.Namespace):
        self.out = out
        self.data = {**header(torch.device("cpu")), "mode": args.mode,
                     "args": {k: v for k, v in vars(args).items() if k != "out"}, "fault": None}
        for distribution in ("nvidia-pytriton", "tritonclient"):  # the server's wheel, the client's
            self.data["versions"][distribution] = importlib.metadata.version(distribution)

    def save(self) -> None:
        write(self.out, "stress", self.data)


def start_server(repository: Path, log_path: Path, glibc_heap: bool = False) -> tuple[TritonServer, float]:
    """A fresh tritonserver serving ``repository`` on free ports, logging to ``log_path`` (``glibc_heap``: without
    the launcher's ``HEAP_ENV``); and the seconds it took to become ready."""
    start = time.perf_counter()
    server = TritonServer(repository, ServerPorts.unused(), ready_timeout_s=600, log_path=log_path,
                          **({"heap_env": {}} if glibc_heap else {})).start()
    return server, since(start)


def stop_server(server: TritonServer, keep_log: bool) -> str | None:
    """Stop ``server`` (``TritonServer.stop``: None, or what went wrong); its log is removed unless ``keep_log``
    or the stop went wrong."""
    problem = server.stop()
    if not keep_log and problem is None:
        server.log_path.unlink(missing_ok=True)
    return problem


def grpc_url(server: TritonServer) -> str:
    """``host:port`` of ``server``'s gRPC endpoint."""
    return f"127.0.0.1:{server.ports.grpc}"


def one_burst(url: str, requests: int, media: Media, timeout_s: float) -> dict:
    """Requests 0 to ``requests - 1`` of the mix all at once, each on its own thread and gRPC channel; returns
    the burst's ``seconds``, ``completed``, ``cancelled``, ``error_count`` and the first ``errors``."""
    start = time.perf_counter()
    outcomes = at_once(lambda i: run_request(url, i, media, timeout_s), requests)
    errors = [error for outcome, error in outcomes if outcome == "error"]
    return {"seconds": since(start), "completed": sum(o == "completed" for o, _ in outcomes),
            "cancelled": sum(o == "cancelled" for o, _ in outcomes), "error_count": len(errors),
            "errors": errors[:ERRORS_KEPT]}


def burst(args: argparse.Namespace, repository: Path, out: Path, record: Record) -> int:
    """The burst loop (module docstring); returns the exit status."""
    media = Media.small()
    servers, bursts = record.data.setdefault("servers", []), record.data.setdefault("bursts", [])
    while len(bursts) < args.bursts:
        try:
            server, ready_s = start_server(repository, out / f"server-{len(servers)}.log")
        except RuntimeError as exc:  # the launcher's reason and the log's tail
            record.data["fault"] = f"a fresh server did not start: {str(exc)[-4000:]}"
            record.save()
            return CRASHED
        servers.append({"first_burst": len(bursts), "ready_s": ready_s, "stop": None})
        problem = None
        try:
            for _ in range(min(args.bursts_per_server, args.bursts - len(bursts))):
                result = one_burst(grpc_url(server), args.requests, media, args.timeout_s)
                problem = fault(server) or ("wedged: every request failed"
                                            if result["error_count"] == args.requests else None)
                bursts.append({"burst": len(bursts), "server": len(servers) - 1, **result,
                               "alive": server.process.poll() is None, "fault": problem})
                record.data["fault"] = problem
                record.save()
                print(f"burst {len(bursts) - 1}: {result['seconds']:.1f} s, {result['completed']} completed, "
                      f"{result['cancelled']} cancelled, {result['error_count']} failed"
                      f"{'; ' + problem if problem else ''}", flush=True)
                if problem:
                    keep_log_tail(server, out / "server-log-tail.txt")
                    break
        finally:
            servers[-1]["stop"] = stop_server(server, keep_log=problem is not None)
            record.save()
            if servers[-1]["stop"]:
                print(f"server {len(servers) - 1}: {servers[-1]['stop']}", flush=True)
        if problem:
            return CRASHED
    return FAILED if any(b["error_count"] for b in bursts) else 0


def soak(args: argparse.Namespace, repository: Path, out: Path, record: Record) -> int:
    """The soak (module docstring); returns the exit status."""
    media = Media.small()
    server, ready_s = start_server(repository, out / "server.log")
    counts = {"completed": 0, "cancelled": 0, "error": 0}
    errors: list[str] = []
    samples: list[dict] = []
    data = record.data
    data.update(ready_s=ready_s, counts=counts, errors=errors, samples=samples)
    lock, finished = threading.Lock(), threading.Event()
    start = time.perf_counter()

    def work(i: int) -> None:
        if data["fault"]:
            return  # the server is gone: the rest are not sent
        outcome, error = run_request(grpc_url(server), i, media, args.timeout_s)
        with lock:
            counts[outcome] += 1
            if error and len(errors) < ERRORS_KEPT:
                errors.append(error)

    def sample() -> None:
        while not finished.wait(args.sample_s):
            data["fault"] = data["fault"] or fault(server)
            if sum(counts.values()) >= args.warmup:
                samples.append({"seconds": since(start), "ended": sum(counts.values()),
                                "memory_mb": server_memory_mb(server)})
            record.save()

    sampler = threading.Thread(target=sample, name="rss-sampler", daemon=True)
    sampler.start()
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(work, range(args.requests)))
        finished.set()
        sampler.join()
        data["seconds"] = since(start)
        data["fault"] = data["fault"] or fault(server)
        if not data["fault"]:
            gauges = wait_for_idle_pools(server, timeout_s=120)
            data["pages_at_end"] = {name.removeprefix("unifiedserve_"): gauges[f"unifiedserve_{name}"] for name in
                                    ("kv_pages_free", "kv_pages_total", "patch_pages_free", "patch_pages_total",
                                     "num_requests_running")}
            data["idle_memory_mb"] = server_memory_mb(server)
        else:
            keep_log_tail(server, out / "server-log-tail.txt")
    finally:
        finished.set()
        data["stop"] = stop_server(server, keep_log=bool(data["fault"]))
        record.save()
    if data["fault"]:
        return CRASHED
    if samples:
        data["growth"] = growth(samples[0]["memory_mb"], samples[-1]["memory_mb"])
        data["idle_growth"] = growth(samples[0]["memory_mb"], data["idle_memory_mb"])
    pages = data["pages_at_end"]
    data["checks"] = {
        "no_errors": counts["error"] == 0,
        "pages_free": pages["kv_pages_free"] == pages["kv_pages_total"]
        and pages["patch_pages_free"] == pages["patch_pages_total"],
        "rss_growth_under_limit": bool(samples) and all(g["growth"] < args.max_growth
                                                        for g in data["growth"].values()),
    }
    record.save()
    print(f"soak: {data['seconds']:.0f} s, {counts}; pages at end {pages}; growth "
          + ", ".join(f"{name} {g['start_mb']:.0f}->{g['end_mb']:.0f} MB"
                      for name, g in data.get("growth", {}).items()),
          flush=True)
    return 0 if all(data["checks"].values()) else FAILED


def upload(url: str, i: int, images: list[bytes], timeout_s: float) -> str | None:
    """Request ``i`` with every one of ``images``, seen at most 100,000 pixels each (``max_pixels``: the bytes are
    large, the model's work small), 4 tokens; its error, or None."""
    try:
        with Client(url) as client:
            client.generate(f"Upload {i}: describe them.", image=images, timeout_s=timeout_s,
                            sampling={"max_tokens": 4, "max_pixels": 100_000})
    except (ServerError, TimeoutError) as exc:
        return f"request {i}: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def payload(args: argparse.Namespace, repository: Path, out: Path, record: Record) -> int:
    """The payload rounds (module docstring); returns the exit status."""
    images = [Media.noise_png(args.side, seed) for seed in range(args.images)]
    server, ready_s = start_server(repository, out / "server.log", args.glibc_heap)
    data = record.data
    samples: list[dict] = []
    data.update(ready_s=ready_s, image_bytes=[len(image) for image in images], samples=samples)
    try:
        for k in range(-1, args.rounds):  # round -1: text alone, the baseline
            errors = [e for e in at_once(lambda i: upload(grpc_url(server), i, images if k >= 0 else [],
                                                          args.timeout_s), args.requests) if e]
            wait_for_idle_pools(server, timeout_s=120)
            time.sleep(2.0)  # threads that free the last buffers after the pages
            samples.append({"round": k, "errors": errors, "memory_mb": server_memory_mb(server)})
            print(f"round {k}: {len(errors)} failed; " + ", ".join(
                f"{name} {mb['rss']:.0f} MB ({mb['anon']:.0f} anon, {mb['shmem']:.0f} shmem)"
                for name, mb in samples[-1]["memory_mb"].items()), flush=True)
            record.save()
            if errors:
                break
        data["fault"] = fault(server)
        data["growth"] = growth(samples[0]["memory_mb"], samples[-1]["memory_mb"])
    finally:
        data["stop"] = stop_server(server, keep_log=bool(data["fault"]))
        record.save()
    return CRASHED if data["fault"] else FAILED if any(s["errors"] for s in samples) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    burst_args, soak_args, payload_args = (modes.add_parser(mode) for mode in ("burst", "soak", "payload"))
    for mode, requests, what in ((burst_args, 200, "requests per burst"), (soak_args, 10_000, "requests in all"),
                                 (payload_args, 4, "requests per round")):
        mode.add_argument("--out", required=True, type=Path, help="folder for stress.json and the server log")
        mode.add_argument("--requests", type=int, default=requests, help=what)
        mode.add_argument("--timeout-s", type=float, default=600.0, help="each request's client timeout (s)")
        mode.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE", dest="overrides",
                          help="serve the repository with this model parameter changed (repeatable), as the launcher")
    burst_args.add_argument("--bursts", type=int, default=50)
    burst_args.add_argument("--bursts-per-server", type=int, default=10, help="bursts before a fresh server")
    soak_args.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    soak_args.add_argument("--warmup", type=int, default=1000, help="requests ended before RSS is sampled")
    soak_args.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    soak_args.add_argument("--max-growth", type=float, default=0.05, help="RSS growth that fails (fraction)")
    payload_args.add_argument("--rounds", type=int, default=3)
    payload_args.add_argument("--images", type=int, default=4, help="images per request")
    payload_args.add_argument("--side", type=int, default=1500, help="each image's width and height (pixels)")
    payload_args.add_argument("--glibc-heap", action="store_true",
                              help="serve without the launcher's HEAP_ENV (glibc's own mmap threshold), to compare")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record = Record(args.out, args)
    record.save()
    run = {"burst": burst, "soak": soak, "payload": payload}[args.mode]
    if not args.overrides:
        return run(args, REPO_ROOT / "model_repository", args.out, record)
    with tempfile.TemporaryDirectory(prefix="stress-repository-") as edited:
        return run(args, repository_with(Path(edited), parse_overrides(args.overrides)), args.out, record)


if __name__ == "__main__":
    sys.exit(main())
