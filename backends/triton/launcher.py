"""Start and stop a real ``tritonserver`` with UnifiedServe's model repository.

The binary comes from ``/opt/tritonserver`` or the ``nvidia-pytriton`` wheel (``backends.triton.server_binary``).
A server gets a run directory (``backends.ipc.run_dir``) and a lock in /dev/shm that it and its launcher hold
(``backends.triton.stale_shm``: files of servers that are gone are removed before a start); it is stopped by the
drain of ``backends.triton.server_stop``, and a server whose model process or OpenAI API died is stopped for a
supervisor to restart (``backends.triton.stubs.watch_stages``).

Usage: ``python -m backends.triton.launcher [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
[--config DEPLOY.yaml] [--model PATH] [--openai-port 9000] [--set MODEL.KEY=VALUE ...]``; Ctrl-C stops the
server. ``--config``, ``--model`` and ``--set`` serve a copy of the repository with model parameters changed
(``backends/triton/launch_options.py``). While the models load, it prints their progress to stderr
(``backends/triton/load_progress.py``). Once the server is ready, the OpenAI-compatible API starts beside it
(``backends.openai``; ``--openai-port 0``: none), and it stops first (its requests in flight get its grace; the
models fail those left near its end, so that each gets an error). Tests use :class:`TritonServer` as a context
manager.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from backends.ipc.run_dir import RUN_DIR_ENV
from backends.openai.process import ApiProcess, check_port_free
from backends.triton import launch_options, openai_options, server_stop
from backends.triton.deploy_config import DEFAULT_SHM_BYTES
from backends.triton.load_progress import LoadProgress
from backends.triton.mps import MpsDaemon
from backends.triton.parent_death import ends_with_parent
from backends.triton.ports import WILDCARDS, ServerPorts, clashing, listens_on, port_option
from backends.triton.repository import repository_with
from backends.triton.server_binary import (HEAP_ENV, TRITON_EXIT_TIMEOUT_S, server_binary, server_command,
                                           thread_stacks)
from backends.triton.server_log import load_errors, not_unloaded, still_loading
from backends.triton.stale_shm import SHM, lock_path, remove_run_files, remove_stale_shared_memory
from backends.triton.stubs import dump_stacks, stub_processes, stub_regions, watch_stages
from flashcodec.parallel import TMP_PREFIX_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
EXIT_TIMEOUT_S = 15.0  # the launcher's SIGKILL after its SIGINT, for a server that does not exit by itself
# a stop this slow: the stubs' stacks go to the log before tritonserver gives up (TRITON_EXIT_TIMEOUT_S) and takes them
STACKS_AFTER_S = TRITON_EXIT_TIMEOUT_S - 2
STAGE_DIED = 3  # the launcher's exit status when a model's process died (it stopped the server) or tritonserver did
DIED_EXIT_TIMEOUT_S = 5.0  # then: seconds from SIGINT to SIGKILL, so that clients see the connection drop soon


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
    heap_env: dict[str, str] = field(default_factory=lambda: dict(HEAP_ENV))  # {}: glibc's own heap behaviour
    log_to_stdout: bool = False  # inherit stdout (containers: `docker logs`) instead of writing log_path
    shm_default_byte_size: int = DEFAULT_SHM_BYTES  # the Python backend's shared memory per model process
    on_log: Callable[[Path], None] | None = None  # told the log's path before the server starts (load_progress)
    gpu_sharing: str = "time_slicing"  # or "mps": an MPS daemon for the server's processes (backends.triton.mps)
    admin_header: tuple[str, str] | None = None  # (name, value) the log and trace APIs ask for (restricted_api_flags)
    process: subprocess.Popen | None = None
    run_dir: Path | None = None
    ready_stubs: dict[int, str] = field(default_factory=dict)  # `stubs()` once ready: what `watch_stages` expects
    regions: set[str] = field(default_factory=set)  # its stubs' shm regions once ready (`stubs.stub_regions`)
    mps: MpsDaemon | None = None  # with gpu_sharing mps: the daemon its processes are clients of
    ends_with_launcher: bool = False  # SIGTERM to tritonserver when this process dies (parent_death; the CLI's)
    _lock: object = field(default=None, init=False, repr=False)  # the open lock file (stale_shm)
    _log: object = field(default=None, init=False, repr=False)  # the log as tritonserver writes it (shared offset)
    _stop_announced: bool = field(default=False, init=False, repr=False)

    def start(self) -> "TritonServer":
        """Start and wait until ready. Raises RuntimeError when a port is taken (before starting: otherwise
        another server's ready answer would pass for ours), when MPS is asked for and cannot start
        (``MpsDaemon.start``), when the server exits or is not ready in time; an interrupt while waiting (Ctrl-C, or
        SIGTERM through main) stops the server before it propagates."""
        self.ports.check_free()
        self._stop_announced = False
        binary, backends, env = server_binary()
        remove_stale_shared_memory()
        self.run_dir = Path(tempfile.mkdtemp(prefix="unifiedserve-run-"))
        # Held by this launcher and the server (inherited): while either lives, no other launcher removes its pools.
        self._lock = open(lock_path(self.run_dir.name), "wb")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        # Beside the run directory, so that it outlives the server (the run directory is removed at stop).
        self.log_path = self.log_path or self.run_dir.with_suffix(".log")
        environment = {**self.heap_env, **os.environ, **env, **self.extra_env, RUN_DIR_ENV: str(self.run_dir),
                       # video bytes written out for decoding: removed with the pools at stop, even after a kill
                       TMP_PREFIX_ENV: f"unifiedserve-{self.run_dir.name}-flashcodec-"}
        environment["PYTHONPATH"] = str(REPO_ROOT)  # for the helpers we start; the stub ignores it
        if self.gpu_sharing == "mps":
            try:
                self.mps = MpsDaemon.start(self.run_dir, environment)
            except BaseException:
                self.stop()  # the run directory and its lock
                raise
            environment.update(self.mps.env())
        command = server_command(binary, backends, self.model_repository, self.ports, self.shm_default_byte_size,
                                 admin_header=self.admin_header)
        self._log = log = None if self.log_to_stdout else open(self.log_path, "wb")
        if log is not None and self.on_log is not None:
            self.on_log(self.log_path)
        with thread_stacks():  # Triton's HTTP front end crashes on a body over half a thread's stack
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                            cwd=str(REPO_ROOT), start_new_session=True, pass_fds=[self._lock.fileno()],
                                            preexec_fn=ends_with_parent() if self.ends_with_launcher else None)
        try:
            self._wait_ready()
            self.ready_stubs = self.stubs()
            self.regions = stub_regions(self.process.pid)
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
            with contextlib.suppress(OSError):  # ready, and its own answer (another server may hold the port)
                if urllib.request.urlopen(url, timeout=2).status == 200 and listens_on(self.process.pid,
                                                                                       self.ports.http) is not False:
                    return
            time.sleep(0.5)
        raise RuntimeError(self._not_started(f"tritonserver not ready within {self.ready_timeout_s} s"))

    def _not_started(self, what: str) -> str:
        """``what`` happened, then each model's reason for not loading (:func:`load_errors`), those whose load had
        begun and not ended (:func:`still_loading`: cut off by an exit, or stuck), then the log's tail."""
        if self.log_to_stdout:  # no log file to read the reasons from: they went to stdout
            return f"{what} (each model's reason is in the server log above)"
        log = self.log_tail(1_000_000)
        reasons = "".join(f"\n  {reason}" for reason in load_errors(log))
        reasons += "".join(f"\n  model {model} was still loading" for model in still_loading(log))
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

    def announce_stop(self) -> None:
        """Tell the models the server is stopping (``server_stop``), once: they fail their requests in flight, so
        that each client gets an error naming the stop. The first step of :meth:`stop`; the launcher calls it
        earlier, near the end of the OpenAI API's grace (``ApiProcess.stop``), so that the API's requests still in
        flight end with that error, relayed. With ``UNIFIEDSERVE_DUMP_STACKS=1`` the stubs' stacks go to the server
        log first. Raises nothing: a stop goes on whatever fails here (logged to stderr)."""
        if self._stop_announced or self.process is None or self.process.poll() is not None:
            return
        self._stop_announced = True
        try:
            if os.environ.get("UNIFIEDSERVE_DUMP_STACKS") == "1":
                self._dump_stub_stacks()
            server_stop.announce(self.run_dir)
        except Exception as exc:  # the drain then waits out its timeout; the stop itself goes on
            print(f"the stop could not be announced to the models: {exc!r}", file=sys.stderr, flush=True)

    def stop(self, drain_timeout_s: float = 10.0, exit_timeout_s: float = EXIT_TIMEOUT_S) -> str | None:
        """Tell the models and let them drain (``server_stop``: requests in flight fail, streams end; at most
        ``drain_timeout_s`` seconds), SIGINT, then SIGKILL of the whole process group after ``exit_timeout_s``
        seconds (the stubs still alive write their threads' stacks to the server log first, at ``STACKS_AFTER_S``
        seconds, :meth:`_wait_stopped`); removes the run directory. Returns None when the server exited by itself
        with status 0; else what went wrong: when it had to be killed, "did not exit within EXIT_TIMEOUT_S s of its
        stop (model NAME had not unloaded)" (or "(every model had unloaded)": tritonserver itself did not exit); when
        tritonserver gave up waiting for a model after its own exit timeout (status 1, "Exit timeout expired" in its
        log), "gave up its stop after its exit timeout (model NAME had not unloaded)"."""
        killed = None
        if self.process is not None and self.process.poll() is None:
            self.announce_stop()
            server_stop.wait_drained(self.run_dir, drain_timeout_s)
            os.killpg(self.process.pid, signal.SIGINT)
            status = self._wait_stopped(exit_timeout_s)
            if status is None:
                killed = f"did not exit within {exit_timeout_s:g} s of its stop ({self._not_unloaded()}): killed"
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            elif status != 0:
                killed = (f"gave up its stop after its exit timeout of {TRITON_EXIT_TIMEOUT_S} s, status {status} "
                          f"({self._not_unloaded()})")
        if self.process is not None:  # stubs still loading when the server exited outlive it: none may stay
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            remove_stale_shared_memory()  # regions of stubs that died (Triton cannot remove them)
            for region in self.regions:  # those of a killed tritonserver, also while other servers run
                (SHM / region).unlink(missing_ok=True)
        if self.mps is not None:  # its clients are gone; its folders are in the run directory
            self.mps.stop()
        if self._log is not None:
            self._log.close()
        if self.run_dir is not None:
            remove_run_files(self.run_dir.name)  # its pools and its lock
            self._lock.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return killed

    def _wait_stopped(self, exit_timeout_s: float) -> int | None:
        """tritonserver's exit status once it exits within ``exit_timeout_s`` of its SIGINT, else None. A stop that
        takes ``STACKS_AFTER_S`` seconds has the stubs' stacks written to the log first (what the stubs left were
        doing, for whoever looks into it), while tritonserver still waits for them: past its own exit timeout it
        exits and takes them along (a fresh user's long session, 2026-12-05, left no stacks that way)."""
        try:
            return self.process.wait(timeout=min(exit_timeout_s, STACKS_AFTER_S))
        except subprocess.TimeoutExpired:
            self._dump_stub_stacks()
        try:
            return self.process.wait(timeout=max(0.0, exit_timeout_s - STACKS_AFTER_S))
        except subprocess.TimeoutExpired:
            return None

    def _not_unloaded(self) -> str:
        return not_unloaded(self.log_tail(1_000_000), self.ready_stubs.values())

    def stubs(self) -> dict[int, str]:
        """This server's Python-backend stub processes that are alive: pid -> model (``stubs.stub_processes``)."""
        return stub_processes(self.process.pid)

    def _dump_stub_stacks(self) -> None:
        """Each stub of this server writes all its threads' stacks to the log, one after the other, each after a line
        naming its model (``stubs.dump_stacks``)."""
        out = self._log or sys.stdout  # the file tritonserver and its stubs write: their offset, not another

        def note(line: str) -> None:
            out.write(f"{line}\n".encode() if out is self._log else f"{line}\n")
            out.flush()

        dump_stacks(self.stubs(), note=note)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop_signal(signum, frame) -> None:
    """The first SIGINT or SIGTERM: a KeyboardInterrupt, which stops the server; later ones are ignored: a second Ctrl-C
    cannot cut the stop short and leave tritonserver (its own session) running. The stop's steps have timeouts."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--address", default="127.0.0.1", help="0.0.0.0 to serve other machines")
    parser.add_argument("--http-port", type=port_option, default=8000)
    parser.add_argument("--grpc-port", type=port_option, default=8001)
    parser.add_argument("--metrics-port", type=port_option, default=8002)
    openai_options.add_arguments(parser)
    parser.add_argument("--log-stdout", action="store_true", help="server log to stdout instead of a file")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the models to load")
    parser.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE", dest="overrides",
                        help="change a model parameter of config.pbtxt (repeatable), e.g. decode.kv_pages=8192;"
                             " *.KEY=VALUE sets it in every model that has it, as does naming one model for the"
                             " served model's keys (preset, model_path, load_format, dtype, seed, share_weights)")
    launch_options.add_arguments(parser)
    args = parser.parse_args(argv)
    openai_options.check(parser, args)
    api_elsewhere = args.openai_address not in (None, args.address) and WILDCARDS.isdisjoint(
        (args.openai_address, args.address))  # the API on another address may reuse a port number
    clash = clashing({"--http-port": args.http_port, "--grpc-port": args.grpc_port,
                      "--metrics-port": args.metrics_port, "--openai-port": 0 if api_elsewhere else args.openai_port})
    if clash:
        parser.error(clash)
    # SIGTERM stops it like Ctrl-C, also while the repository copy is written or the server starts; SIGINT too
    # when started in the background (where it is inherited as ignored).
    signal.signal(signal.SIGTERM, _stop_signal)
    signal.signal(signal.SIGINT, _stop_signal)
    source = args.model_repository.resolve()
    try:
        plan = launch_options.serve_plan(args, source)
    except ValueError as exc:
        parser.error(str(exc))
    if args.render:
        api = openai_options.api_config(args) if args.openai_port else None
        return launch_options.render(plan, source, args.render, _ports(args), args.admin_header, api)
    try:
        with tempfile.TemporaryDirectory(prefix="unifiedserve-repository-") as edited:
            repository = repository_with(Path(edited), plan.overrides, source) if plan.overrides else source
            return _serve(args, repository, plan)
    except KeyboardInterrupt:  # before the server started (it stops its own when interrupted while starting)
        print("stopped before the server started", file=sys.stderr)
        return 130


def _ports(args: argparse.Namespace) -> ServerPorts:
    return ServerPorts(args.http_port, args.grpc_port, args.metrics_port, args.address)


def _serve(args: argparse.Namespace, repository: Path, plan: launch_options.ServePlan) -> int:
    ports = _ports(args)
    progress = LoadProgress(lambda text: print(text, file=sys.stderr, flush=True))
    server = TritonServer(repository, ports, ready_timeout_s=args.ready_timeout, log_to_stdout=args.log_stdout,
                          shm_default_byte_size=plan.shm_default_byte_size, on_log=progress.follow,
                          gpu_sharing=plan.gpu_sharing, admin_header=args.admin_header, ends_with_launcher=True)
    try:
        if args.openai_port:  # now, not after the server's minutes of loading
            check_port_free(args.openai_address or args.address, args.openai_port)
        try:
            server.start()
        finally:
            progress.stop()
    except KeyboardInterrupt:
        print("stopped while starting", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        log = f"\n(log: {server.log_path})" if server.process is not None and not args.log_stdout else ""
        print(f"tritonserver did not start: {exc}{log}", file=sys.stderr)
        return 1
    died, killed, api, api_failed = None, None, None, False
    try:  # from here on a stop signal (a KeyboardInterrupt), even one right after the ready line, stops the server
        where = "stdout" if args.log_stdout else server.log_path
        print(f"tritonserver ready: gRPC {args.address}:{args.grpc_port}, HTTP {args.address}:{args.http_port}, "
              f"log {where}, models {repository}", flush=True)
        if args.openai_port:
            api = ApiProcess(openai_options.api_config(args),
                             None if args.log_stdout else server.log_path.with_suffix(".openai.log"),
                             ends_with_launcher=True)
            try:
                api.start(server_gone=lambda: server.process.poll() is not None)
                print(f"OpenAI-compatible API: {api.url}/v1, log {api.log_path or 'stdout'}", flush=True)
            except RuntimeError:
                if server.process.poll() is None:
                    raise  # else the server's death is what to report (watch_stages, at once)
        died = watch_stages(server, api.exit_reason if api is not None else None)
        if died:
            where = "" if args.log_stdout else f" (log {server.log_path})"
            print(f"{died}{where}: stopping, exit status {STAGE_DIED} for a supervisor to start the server again",
                  file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("stopping: the models end the requests in flight and unload", file=sys.stderr, flush=True)
    except (RuntimeError, ValueError) as exc:  # the API did not start, or its settings are wrong
        print(exc, file=sys.stderr, flush=True)
        api_failed = True
    finally:
        if api is not None:  # before the drain: no new connection reaches a server that is stopping; requests in
            # flight get the API's grace, those still running near its end the models' "shutting down" error
            api.stop(before_grace_ends=None if died else server.announce_stop)
        if died:  # its requests can neither drain nor end: Triton would wait out its exit timeout (20 s, twice)
            server.stop(drain_timeout_s=2.0, exit_timeout_s=DIED_EXIT_TIMEOUT_S)
        else:
            killed = server.stop()
    if api_failed:
        return 1
    if killed:  # the stop was asked for and nothing is left running: said, not an error status
        where = "" if args.log_stdout else f"; see {server.log_path}"
        print(f"tritonserver {killed}{where}", file=sys.stderr, flush=True)
        return 0
    print("tritonserver stopped" if not died else "tritonserver stopped (after the end above)", file=sys.stderr)
    return STAGE_DIED if died else server.process.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
