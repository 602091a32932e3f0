"""Where the ``tritonserver`` binary and its backends come from, and its command line.

``/opt/tritonserver`` when it exists (NGC images); otherwise the ``nvidia-pytriton`` wheel (tritonserver 2.51):
its ``tritonserver`` folder is copied once to a writable cache (``UNIFIEDSERVE_CACHE``, default
``~/.cache/unifiedserve``), and the wheel's Python-backend stub built for the running interpreter's Python
version is put next to the backend, where tritonserver looks for it.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import resource
import secrets
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from backends.triton.ports import ServerPorts

NGC_SERVER = Path("/opt/tritonserver")
CACHE = Path(os.environ.get("UNIFIEDSERVE_CACHE", Path.home() / ".cache" / "unifiedserve"))

# glibc raises its mmap threshold (up to 32 MiB) each time a block it had mapped is freed, so after a few uploads
# blocks of up to 32 MiB come from the heap arenas and stay with the process once freed: flashcodec kept 300 MB more
# after two rounds of two 48 MB PNGs, 66 MB with this (bench/RESULTS.md, "memory after large payloads"). A fixed
# threshold turns that off: every block of 4 MiB or more (request bytes, decoded images and frames) is mapped for
# itself and goes back to the system when freed. malloc_trim(0) whenever flashcodec or the orchestrator went idle
# returned little more in a trial, so nothing calls it. The stubs inherit it from tritonserver; the launcher sets it
# (a value in its own environment wins) and --render's command names it.
HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 20)}

# Triton 2.51's HTTP front end takes about twice a request body's size of the stack of the thread that reads it, and
# a body over half the stack crashes the whole server (SIGSEGV; triton-inference-server/server#5840): with Linux's
# usual 8 MiB a 4 MiB body did (a 3 MiB one was served); with 16 MiB 8 MiB did (7 served). A thread's stack is
# the soft RLIMIT_STACK the process started with (glibc), so tritonserver starts with this one: JSON bodies up to
# about 60 MiB (a video's data: URL; gRPC has no such limit). Stacks are address space, taken as they are used.
THREAD_STACK_BYTES = 128 << 20
TRITON_EXIT_TIMEOUT_S = 10  # tritonserver's --exit-timeout-secs: after the launcher's drain nothing is left to wait for


def server_binary() -> tuple[Path, Path, dict[str, str]]:
    """(tritonserver binary, backend directory, extra environment for the server). Raises RuntimeError when
    there is neither an NGC server nor the wheel, or the wheel has no stub for this Python."""
    if (NGC_SERVER / "bin" / "tritonserver").exists():
        return NGC_SERVER / "bin" / "tritonserver", NGC_SERVER / "backends", {}
    return _wheel_server()


def _wheel_server() -> tuple[Path, Path, dict[str, str]]:
    """(tritonserver binary, backend directory, extra environment) built from the pip wheel."""
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
        "PATH": first_on_path(str(Path(sys.executable).parent), os.environ.get("PATH", "")),
    }
    return target / "bin" / "tritonserver", target / "backends", env


def first_on_path(folder: str, path: str) -> str:
    """``path`` (a PATH value) with ``folder`` first, once, and no empty entry (one would stand for the working
    folder)."""
    return ":".join(dict.fromkeys([folder, *(entry for entry in path.split(":") if entry)]))


@contextlib.contextmanager
def thread_stacks(nbytes: int = THREAD_STACK_BYTES):
    """This process's soft RLIMIT_STACK raised to ``nbytes`` (bytes; at most the hard limit) while the block runs, so
    that a process started in it (tritonserver, then its stubs) gives its threads stacks that large; restored
    after. One that is larger already is kept (an unlimited one is not: glibc then gives threads its own default)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    wanted = nbytes if hard == resource.RLIM_INFINITY else min(nbytes, hard)
    if soft != resource.RLIM_INFINITY and soft >= wanted:
        yield
        return
    resource.setrlimit(resource.RLIMIT_STACK, (wanted, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_STACK, (soft, hard))


# what any client could use otherwise: the server's log and trace settings, and shared memory (a client may register
# any /dev/shm region, the stages' pools' and the Python backend's with every request's tensors among them, and read
# or write it through its requests: Triton 2.51 checks no name, the class of CVE-2025-23319, fixed in Triton 25.07)
RESTRICTED_APIS = "logging,trace,shared-memory"
SHM_HEADER = "x-unifiedserve-shared-memory"  # the header shared memory asks for without --admin-header


def restricted_api_flags(admin_header: tuple[str, str] | None) -> list[str]:
    """Triton's flags that keep ``RESTRICTED_APIS`` (HTTP and gRPC) to requests carrying the header ``admin_header``
    (name, value); without one, shared memory alone, to :data:`SHM_HEADER` with a value made here and told nobody
    (no client may register a region; the log and trace settings stay open, Triton's default)."""
    name, value = admin_header or (SHM_HEADER, secrets.token_hex(16))
    rule = f"{RESTRICTED_APIS if admin_header else 'shared-memory'}:{name}={value}"
    return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]


def server_command(binary: Path, backends: Path | None, repository: Path, ports: ServerPorts,
                   shm_default_byte_size: int, exit_timeout_s: int = TRITON_EXIT_TIMEOUT_S,
                   admin_header: tuple[str, str] | None = None) -> list[str]:
    """The tritonserver command line serving ``repository`` on ``ports`` (the launcher's and ``--render``'s):
    ``backends`` the backend directory (None: tritonserver's default, an NGC image's), ``shm_default_byte_size`` the
    Python backend's shared-memory region per model process (bytes), ``exit_timeout_s`` Triton's
    ``--exit-timeout-secs`` (seconds), ``admin_header`` what :func:`restricted_api_flags` restricts the log and trace
    settings to."""
    p = ports
    return [
        str(binary),
        f"--model-repository={repository}",
        *([f"--backend-directory={backends}"] if backends is not None else []),
        f"--http-address={p.address}", f"--http-port={p.http}",
        f"--grpc-address={p.address}", f"--grpc-port={p.grpc}",
        f"--metrics-address={p.address}", f"--metrics-port={p.metrics}",
        f"--backend-config=python,shm-default-byte-size={shm_default_byte_size}",
        f"--exit-timeout-secs={exit_timeout_s}",
        *restricted_api_flags(admin_header),
    ]
