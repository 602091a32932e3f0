"""The three ports a tritonserver binds: HTTP (KServe + generate_stream), gRPC, Prometheus metrics."""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import socket
from dataclasses import dataclass

WILDCARDS = frozenset({"0.0.0.0", "::", ""})  # addresses that bind every interface: they share ports with any
PORT_RANGE = range(1, 65536)  # TCP ports a server may bind by number (0 asks the kernel for any)


def port_option(text: str, off: str = "") -> int:
    """argparse ``type`` of a ``--*-port`` option: an integer in 1..65535, or 0 where ``off`` says what 0 means.

    Raises:
        argparse.ArgumentTypeError: not an integer, or out of that range (argparse names the option)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if port not in PORT_RANGE and not (off and port == 0):
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port: use 1..65535" + (f" (0: {off})" if off else ""))
    return port


def optional_port_option(text: str) -> int:
    """:func:`port_option` of a server that 0 leaves unstarted (the OpenAI API's)."""
    return port_option(text, off="no API")


def clashing(named: dict[str, int]) -> str | None:
    """A message naming two options given the same port (``{option: port}``; 0, no port, is never a clash), else
    None: each of the launcher's servers needs a port of its own."""
    seen: dict[int, str] = {}
    for option, port in named.items():
        if port and port in seen:
            return f"{seen[port]} and {option} are both {port}: each server needs a port of its own"
        seen.setdefault(port, option)
    return None


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
        """Raises RuntimeError naming the first port another process holds on ``address`` (:func:`check_bindable`)."""
        for name in ("http", "grpc", "metrics"):
            check_bindable(self.address, getattr(self, name), f"{name} port", "--address",
                           f"another server holds it; choose another with --{name}-port")


def check_bindable(address: str, port: int, what: str, address_flag: str, busy_hint: str) -> None:
    """Raises RuntimeError when a server could not bind ``address:port`` (as it binds: a port left in TIME_WAIT by a
    stopped server is free, a listener's is not): naming ``address_flag`` where the address is none of this
    machine's (EADDRNOTAVAIL, not the port), else ``what`` (e.g. "http port") as not free, with ``busy_hint``."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                raise RuntimeError(f"{address_flag} {address} is not an address of this machine ({exc.strerror}): "
                                   "give one of its own, or 0.0.0.0 for all") from None
            raise RuntimeError(f"{what} {address}:{port} is not free ({exc.strerror}): {busy_hint}") from None


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a listening TCP socket on ``port`` (any address, IPv4 or IPv6), read from
    Linux's ``/proc/net/tcp``, ``tcp6`` (the LISTEN sockets' inodes) and ``/proc/<pid>/fd``; None where /proc cannot
    tell (another system, or the process's descriptors not readable). A launcher whose port another server took
    between its check and its server's bind (two launchers started at once: the first binds only once its models have
    loaded) finds that server's health answering 200 while its own never binds: a fresh user's test, 2026-12-07."""
    listening = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(FileNotFoundError), open(table) as rows:
                for row in list(rows)[1:]:
                    fields = row.split()  # sl, local address:port (hex), remote, state (0A: LISTEN), ..., inode
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        listening.add(f"socket:[{fields[9]}]")
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        with contextlib.suppress(OSError):  # closed since it was listed (the listing's own, for one)
            if os.readlink(f"/proc/{pid}/fd/{fd}") in listening:
                return True
    return False
