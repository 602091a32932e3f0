"""Start and stop a real ``tritonserver`` with UnifiedServe's model repository.

The binary comes from ``/opt/tritonserver`` when it exists (NGC images), otherwise from the
``nvidia-pytriton`` wheel (tritonserver 2.51): its ``tritonserver`` folder is copied once to a
writable place, and the Python-backend stub that matches the running interpreter is put next to the
backend (../shared/docs/triton.md, "Getting a real tritonserver without Docker").

Usage: ``python -m backends.triton.launcher [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
[--set MODEL.KEY=VALUE ...]``; Ctrl-C stops the server. ``--set`` serves a copy of the repository with
those model parameters changed (``backends/triton/repository.py``). Tests use :class:`TritonServer` as a context
manager.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from backends.triton import server_stop
from backends.triton.repository import parse_overrides, repository_with
from backends.ipc.run_dir import RUN_DIR_ENV
from flashcodec.parallel import TMP_PREFIX_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
NGC_SERVER = Path("/opt/tritonserver")
CACHE = Path(os.environ.get("UNIFIEDSERVE_CACHE", Path.home() / ".cache" / "unifiedserve"))
TRITON_EXIT_TIMEOUT_S = 10  # tritonserver's --exit-timeout-secs: after the launcher's drain nothing is left to wait for
EXIT_TIMEOUT_S = 15.0  # the launcher's SIGKILL after its SIGINT, for a server that does not exit by itself


@dataclass(frozen=True)
class ServerPorts:
    """Ports bound on ``address``: HTTP (KServe + generate_stream), gRPC, Prometheus metrics."""

    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002
    address: str = "127.0.0.1"

    @classmethod
    def unused(cls, address: str = "127.0.0.1") -> "ServerPorts":
        """Three distinct ports the kernel reports free on ``address`` now (tests and benchmarks beside other
        servers); all three are held while picking, so none is handed out twice."""
        with contextlib.ExitStack() as stack:
            probes = [stack.enter_context(socket.socket()) for _ in range(3)]
            for probe in probes:
                probe.bind((address, 0))
            return cls(*(probe.getsockname()[1] for probe in probes), address)

    def check_free(self) -> None:
        """Raises RuntimeError naming the first port another process holds on ``address``."""
        for name in ("http", "grpc", "metrics"):
            port = getattr(self, name)
            with socket.socket() as probe:
                # As the server binds: a port left in TIME_WAIT by a stopped server is free, a listener's is not.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((self.address, port))
                except OSError as exc:
                    raise RuntimeError(f"{name} port {self.address}:{port} is not free ({exc.strerror}): another "
                                       f"server holds it; choose another with --{name}-port") from None


def _wheel_server() -> tuple[Path, Path, dict[str, str]]:
    """(tritonserver binary, backend directory, extra environment) built from the pip wheel."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no tritonserver: install nvidia-pytriton==0.7.0 or run in an NGC tritonserver image")
    package = Path(list(spec.submodule_search_locations)[0])
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    target = CACHE / f"tritonserver-py{version}"
    stub = target / "backends" / "python" / "triton_python_backend_stub"
    if not stub.exists():
        tmp = Path(tempfile.mkdtemp(dir=CACHE.parent if CACHE.parent.exists() else None))
        shutil.copytree(package / "tritonserver", tmp / "server", symlinks=True)
        source_stub = tmp / "server" / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not source_stub.exists():
            raise RuntimeError(f"the nvidia-pytriton wheel has no Python-backend stub for Python {version}")
        shutil.copy2(source_stub, tmp / "server" / "backends" / "python" / "triton_python_backend_stub")
        (tmp / "server" / "backends" / "python" / "triton_python_backend_stub").chmod(0o755)
        (tmp / "server" / "bin" / "tritonserver").chmod(0o755)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        (tmp / "server").rename(target)
        shutil.rmtree(tmp, ignore_errors=True)
    libs = [str(package.parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR") or ""]
    env = {
        "LD_LIBRARY_PATH": ":".join([*libs, os.environ.get("LD_LIBRARY_PATH", "")]).strip(":"),
        # The stub finds its site-packages through the `python3` first on PATH.
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    return target / "bin" / "tritonserver", target / "backends", env


def _server_binary() -> tuple[Path, Path, dict[str, str]]:
    if (NGC_SERVER / "bin" / "tritonserver").exists():
        return NGC_SERVER / "bin" / "tritonserver", NGC_SERVER / "backends", {}
    return _wheel_server()


def _tritonserver_running() -> bool:
    for status in Path("/proc").glob("[0-9]*/comm"):
        try:
            if status.read_text().strip() == "tritonserver":
                return True
        except OSError:
            continue
    return False


SHM = Path("/dev/shm")
# A server's files there: "unifiedserve-<run>-<pool>" (shared_tensor) and "unifiedserve-<run>.lock", <run> being its
# run directory's name (tempfile.mkdtemp: "unifiedserve-run-" and [a-z0-9_])
_RUN_FILE = re.compile(r"^unifiedserve-(unifiedserve-run-[a-z0-9_]+)[-.]")


def lock_held(lock: Path) -> bool:
    """Whether a server holds ``lock`` (an flock, which holds across containers that share /dev/shm)."""
    try:
        with open(lock, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


STALE_RUN_DIR_S = 60.0


def remove_stale_shared_memory() -> list[Path]:
    """Remove the files of servers that are gone: Python-backend shm regions and UnifiedServe pools.

    A server's pools go once its lock (``unifiedserve-<run>.lock``, held by it and its launcher) is free, and with
    them its run directory (``<tmp>/<run>``, which a killed launcher leaves; its log ``<tmp>/<run>.log`` is kept);
    pools without a lock, run directories without one (older than ``STALE_RUN_DIR_S``), and the Python backend's
    regions (whose names do not say whose they are), only when no tritonserver runs here at all. So a live server's
    files are never touched, also one in another container sharing /dev/shm (``--ipc=host``). Returns the removed
    paths.
    """
    alone = not _tritonserver_running()
    stale = [*SHM.glob("triton_python_backend_shm_region_*")] if alone else []
    runs: dict[str, list[Path]] = {}
    run_dirs = []
    for path in SHM.glob("unifiedserve-*"):
        if match := _RUN_FILE.match(path.name):
            runs.setdefault(match.group(1), []).append(path)
        elif alone:
            stale.append(path)
    for run, paths in runs.items():
        lock = SHM / f"unifiedserve-{run}.lock"
        if (alone and not lock.exists()) or (lock.exists() and not lock_held(lock)):
            stale += paths
            run_dir = Path(tempfile.gettempdir()) / run
            if run_dir.is_dir():
                run_dirs.append(run_dir)
    if alone:  # run directories whose lock is gone (an earlier sweep took it): no server of theirs is left
        for folder in Path(tempfile.gettempdir()).glob("unifiedserve-run-*"):
            try:  # not one a launcher made a moment ago, before taking its lock
                idle_s = time.time() - folder.stat().st_mtime
            except OSError:  # gone meanwhile
                continue
            if folder.is_dir() and folder not in run_dirs and idle_s > STALE_RUN_DIR_S and not (
                    SHM / f"unifiedserve-{folder.name}.lock").exists():
                run_dirs.append(folder)
    for path in stale:
        path.unlink(missing_ok=True)
    for folder in run_dirs:
        shutil.rmtree(folder, ignore_errors=True)
    return stale + run_dirs


@dataclass
class TritonServer:
    """A tritonserver process serving ``model_repository`` (a context manager).

    ``start()`` returns once the server reports ready; raises RuntimeError (with the log's tail) when
    it exits or is not ready within ``ready_timeout_s`` seconds.
    """

    model_repository: Path = REPO_ROOT / "model_repository"
    ports: ServerPorts = field(default_factory=ServerPorts)
    ready_timeout_s: float = 300.0
    log_path: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    log_to_stdout: bool = False  # inherit stdout (containers: `docker logs`) instead of writing log_path
    process: subprocess.Popen | None = None
    run_dir: Path | None = None
    ready_stubs: dict[int, str] = field(default_factory=dict)  # `stubs()` once ready: what `watch_stages` expects
    _lock: object = field(default=None, init=False, repr=False)  # the open lock file (remove_stale_shared_memory)

    def start(self) -> "TritonServer":
        """Start and wait until ready. Raises RuntimeError when a port is taken (before starting: otherwise
        another server's ready answer would pass for ours), when the server exits or is not ready in time;
        an interrupt while waiting (Ctrl-C, or SIGTERM through main) stops the server before it propagates."""
        self.ports.check_free()
        binary, backends, env = _server_binary()
        remove_stale_shared_memory()
        self.run_dir = Path(tempfile.mkdtemp(prefix="unifiedserve-run-"))
        # Held by this launcher and the server (inherited): while either lives, no other launcher removes its pools.
        self._lock = open(SHM / f"unifiedserve-{self.run_dir.name}.lock", "wb")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        # Beside the run directory, so that it outlives the server (the run directory is removed at stop).
        self.log_path = self.log_path or self.run_dir.with_suffix(".log")
        environment = {**os.environ, **env, **self.extra_env, RUN_DIR_ENV: str(self.run_dir),
                       # video bytes written out for decoding: removed with the pools at stop, even after a kill
                       TMP_PREFIX_ENV: f"unifiedserve-{self.run_dir.name}-flashcodec-"}
        environment["PYTHONPATH"] = str(REPO_ROOT)  # for the helpers we start; the stub ignores it
        p = self.ports
        command = [
            str(binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backends}",
            f"--http-address={p.address}", f"--http-port={p.http}",
            f"--grpc-address={p.address}", f"--grpc-port={p.grpc}",
            f"--metrics-address={p.address}", f"--metrics-port={p.metrics}",
            "--backend-config=python,shm-default-byte-size=16777216",
            f"--exit-timeout-secs={TRITON_EXIT_TIMEOUT_S}",
        ]
        log = None if self.log_to_stdout else open(self.log_path, "wb")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                        cwd=str(REPO_ROOT), start_new_session=True, pass_fds=[self._lock.fileno()])
        try:
            self._wait_ready()
            self.ready_stubs = self.stubs()
        except BaseException:  # not ready, or interrupted: leave no server behind (it has its own session)
            self.stop()
            raise
        threading.Thread(target=self._announce_when_not_live, name="tritonserver-live", daemon=True).start()
        return self

    def _wait_ready(self) -> None:
        url = f"http://{self.ports.address}:{self.ports.http}/v2/health/ready"
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(self._not_started(f"tritonserver exited with {self.process.returncode}"))
            try:
                if urllib.request.urlopen(url, timeout=2).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(self._not_started(f"tritonserver not ready within {self.ready_timeout_s} s"))

    def _not_started(self, what: str) -> str:
        """``what`` happened, then each model's reason for not loading (:func:`load_errors`), then the log's tail."""
        log = self.log_tail(1_000_000)
        reasons = "".join(f"\n  {reason}" for reason in load_errors(log))
        return f"{what}{reasons}\n--- end of the log:\n{log[-6000:]}"

    def _announce_when_not_live(self) -> None:
        """A server stopped by a signal from elsewhere (not :meth:`stop`) closes its HTTP endpoint (2.51), or
        answers "not live", before it unloads its models: tell them (``server_stop``), or their open streams
        would hold them until the exit timeout. A slow answer under load is no stop."""
        url = f"http://{self.ports.address}:{self.ports.http}/v2/health/live"
        process, run_dir = self.process, self.run_dir
        while process.poll() is None and run_dir.exists():
            try:
                urllib.request.urlopen(url, timeout=5)
                stopping = False
            except urllib.error.HTTPError:
                stopping = True
            except urllib.error.URLError as exc:
                stopping = isinstance(exc.reason, ConnectionRefusedError)
            except OSError:
                stopping = False
            if stopping and process.poll() is None:
                with contextlib.suppress(OSError):
                    server_stop.announce(run_dir)
                return
            time.sleep(0.5)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except (OSError, AttributeError):
            return ""

    def stop(self, drain_timeout_s: float = 10.0, exit_timeout_s: float = EXIT_TIMEOUT_S) -> str | None:
        """Tell the models and let them drain (``server_stop``: requests in flight fail, streams end; at most
        ``drain_timeout_s`` seconds), SIGINT, then SIGKILL of the whole process group after ``exit_timeout_s``
        seconds (first asking the stubs still alive for their threads' stacks, which go to the server log); removes
        the run directory. Returns None when the server exited by itself with status 0; else what went wrong: when
        it had to be killed, "did not exit within EXIT_TIMEOUT_S s of its stop (model NAME had not unloaded)" (or
        "(every model had unloaded)": tritonserver itself did not exit); when tritonserver gave up waiting for a
        model after its own exit timeout (status 1, "Exit timeout expired" in its log), "gave up its stop after its
        exit timeout (model NAME had not unloaded)"."""
        killed = None
        if self.process is not None and self.process.poll() is None:
            if os.environ.get("UNIFIEDSERVE_DUMP_STACKS") == "1":
                self._dump_stub_stacks()
            server_stop.announce(self.run_dir)
            server_stop.wait_drained(self.run_dir, drain_timeout_s)
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                if self.process.wait(timeout=exit_timeout_s) != 0:
                    killed = (f"gave up its stop after its exit timeout of {TRITON_EXIT_TIMEOUT_S} s, status "
                              f"{self.process.returncode} ({self._not_unloaded()})")
            except subprocess.TimeoutExpired:
                self._dump_stub_stacks()  # what the stubs left were doing, into the log, for whoever looks into it
                killed = f"did not exit within {exit_timeout_s:g} s of its stop ({self._not_unloaded()}): killed"
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.process is not None:  # stubs still loading when the server exited outlive it: none may stay
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            remove_stale_shared_memory()  # regions of stubs that died (Triton cannot remove them)
        if self.run_dir is not None:
            for pool in SHM.glob(f"unifiedserve-{self.run_dir.name}[-.]*"):  # its pools and its lock
                pool.unlink(missing_ok=True)
            self._lock.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return killed

    def _not_unloaded(self) -> str:
        """"model NAME had not unloaded" for the models whose unload the log does not show, or "every model had
        unloaded"."""
        log = self.log_tail(1_000_000)
        stuck = sorted(model for model in set(self.ready_stubs.values())
                       if f"successfully unloaded '{model}'" not in log)
        return f"model {', '.join(stuck)} had not unloaded" if stuck else "every model had unloaded"

    def stubs(self) -> dict[int, str]:
        """This server's Python-backend stub processes that are alive: pid -> model (the name of the folder of
        the model.py it runs). A stub killed from outside stays a zombie of tritonserver, left out here."""
        alive = {}
        for comm in Path("/proc").glob("[0-9]*/comm"):
            try:
                pid = int(comm.parent.name)
                if not comm.read_text().strip().startswith("triton_python") or os.getpgid(pid) != self.process.pid:
                    continue
                state = (comm.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
                script = (comm.parent / "cmdline").read_bytes().split(b"\0")[1]  # <model>/<version>/model.py
            except (OSError, ValueError, IndexError):  # gone, or exiting (its command line is empty by then)
                continue
            if state not in ("Z", "X"):
                alive[pid] = Path(script.decode(errors="replace")).parent.parent.name
        return alive

    def _dump_stub_stacks(self) -> None:
        """SIGUSR1 to this server's Python-backend stubs: each writes all its threads' stacks to the log."""
        for pid in self.stubs():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(2)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--address", default="127.0.0.1", help="0.0.0.0 to serve other machines")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-stdout", action="store_true", help="server log to stdout instead of a file")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the models to load")
    parser.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE", dest="overrides",
                        help="change a model parameter of config.pbtxt (repeatable), e.g. decode.preset=qwen2_5_vl_7b;"
                             " *.KEY=VALUE sets it in every model that has it")
    args = parser.parse_args(argv)
    # SIGTERM stops it like Ctrl-C, also while the repository copy is written or the server starts; SIGINT too
    # when started in the background (where it is inherited as ignored).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    source = args.model_repository.resolve()
    try:
        overrides = parse_overrides(args.overrides, source)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        with tempfile.TemporaryDirectory(prefix="unifiedserve-repository-") as edited:
            repository = repository_with(Path(edited), overrides, source) if overrides else source
            return _serve(args, repository)
    except KeyboardInterrupt:  # before the server started (it stops its own when interrupted while starting)
        print("stopped before the server started", file=sys.stderr)
        return 130


# Triton's line for a model that did not load: "failed to load 'NAME' version N: Internal: REASON\nAt: ..." (the
# traceback after an escaped newline)
_LOAD_FAILED = re.compile(r"failed to load '([^']+)' version \d+: (?:Internal: )?(.*?)(?:\\n|\"?$)", re.MULTILINE)


def load_errors(log: str) -> list[str]:
    """"model NAME did not load: REASON" for each model that a tritonserver log says failed to load (the
    exception its ``initialize`` raised, first line), in log order, each model once."""
    found: dict[str, str] = {}
    for model, reason in _LOAD_FAILED.findall(log):
        found.setdefault(model, reason)
    return [f"model {model} did not load: {reason}" for model, reason in found.items()]


STAGE_DIED = 3  # the launcher's exit status when it stopped the server because a model's process died
DIED_EXIT_TIMEOUT_S = 5.0  # then: seconds from SIGINT to SIGKILL, so that clients see the connection drop soon


def watch_stages(server: TritonServer, period_s: float = 1.0) -> str | None:
    """Wait while ``server`` runs; return why it must stop when a model's stub process that was there when it became
    ready has died (killed, or out of memory), or None once the server has exited. Triton 2.51 keeps such a model
    READY and fails its requests ("Stub process ... is not healthy") without restarting it, so the server is
    stopped instead, for a supervisor (systemd, Kubernetes) to start a fresh one."""
    expected = Counter(server.ready_stubs.values())
    while server.process.poll() is None:
        missing = expected - Counter(server.stubs().values())
        if missing and server.process.poll() is None:
            return f"the process of model {', '.join(sorted(missing))} has died"
        time.sleep(period_s)
    return None


def _serve(args: argparse.Namespace, repository: Path) -> int:
    ports = ServerPorts(args.http_port, args.grpc_port, args.metrics_port, args.address)
    server = TritonServer(repository, ports, ready_timeout_s=args.ready_timeout, log_to_stdout=args.log_stdout)
    try:
        server.start()
    except KeyboardInterrupt:
        print("stopped while starting", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        log = f"\n(log: {server.log_path})" if server.process is not None and not args.log_stdout else ""
        print(f"tritonserver did not start: {exc}{log}", file=sys.stderr)
        return 1
    where = "stdout" if args.log_stdout else server.log_path
    print(f"tritonserver ready: gRPC {args.address}:{args.grpc_port}, HTTP {args.address}:{args.http_port}, "
          f"log {where}, models {repository}", flush=True)
    died, killed = None, None
    try:
        died = watch_stages(server)
        if died:
            print(f"{died}: stopping the server (exit status {STAGE_DIED}) for a supervisor to restart it",
                  file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        if died:  # its requests can neither drain nor end: Triton would wait out its exit timeout (20 s, twice)
            server.stop(drain_timeout_s=2.0, exit_timeout_s=DIED_EXIT_TIMEOUT_S)
        else:
            killed = server.stop()
    if killed:  # the stop was asked for and nothing is left running: said, not an error status
        where = "" if args.log_stdout else f"; see {server.log_path}"
        print(f"tritonserver {killed}{where}", file=sys.stderr, flush=True)
        return 0
    return STAGE_DIED if died else server.process.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
