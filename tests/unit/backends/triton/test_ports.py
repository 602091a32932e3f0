"""The launcher refuses ports another process listens on, before it starts a server (otherwise that
process's answers would pass for the new server's)."""
import dataclasses
import socket

import pytest

from backends.triton.ports import ServerPorts


def test_a_taken_port_is_named():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        ports = dataclasses.replace(ServerPorts.unused(), grpc=taken)
        with pytest.raises(RuntimeError, match=f"grpc port 127.0.0.1:{taken} is not free.*--grpc-port"):
            ports.check_free()


def test_free_ports_pass():
    ServerPorts.unused().check_free()
