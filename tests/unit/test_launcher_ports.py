"""The launcher refuses ports another process listens on, before it starts a server (otherwise that
process's answers would pass for the new server's)."""
import socket

import pytest

from backends.launcher import ServerPorts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_taken_port_is_named():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        ports = ServerPorts(http=_free_port(), grpc=taken, metrics=_free_port())
        with pytest.raises(RuntimeError, match=f"grpc port 127.0.0.1:{taken} is not free.*--grpc-port"):
            ports.check_free()


def test_free_ports_pass():
    ServerPorts(http=_free_port(), grpc=_free_port(), metrics=_free_port()).check_free()
