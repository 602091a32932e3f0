"""The launcher refuses ports another process listens on, before it starts a server (otherwise that
process's answers would pass for the new server's)."""
import argparse
import dataclasses
import os
import socket
import subprocess
import sys

import pytest

from backends.openai.process import check_port_free
from backends.triton.ports import ServerPorts, clashing, listens_on, port_option


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


@pytest.mark.parametrize("text", ["0", "-1", "65536", "70000", "http"])
def test_a_port_option_outside_1_to_65535_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        port_option(text)
    assert port_option("65535") == 65535 and port_option("1") == 1


def test_two_options_on_one_port_are_named_and_no_port_clashes_with_nothing():
    assert clashing({"--http-port": 8000, "--grpc-port": 8000}) == (
        "--http-port and --grpc-port are both 8000: each server needs a port of its own")
    assert clashing({"--http-port": 8000, "--grpc-port": 8001, "--openai-port": 8001}).startswith("--grpc-port and "
                                                                                                 "--openai-port")
    assert clashing({"--http-port": 8000, "--openai-port": 0, "--metrics-port": 0}) is None


def test_an_address_not_of_this_machine_is_named_as_the_address_not_the_port():
    """10.255.255.1 (a fresh admin's try) is no address of a test machine: binding it fails EADDRNOTAVAIL."""
    with pytest.raises(RuntimeError, match=r"^--address 10\.255\.255\.1 is not an address of this machine"):
        ServerPorts(28950, 28951, 28952, "10.255.255.1").check_free()


def test_the_openai_apis_check_names_its_own_address_and_port_the_same_way():
    """``check_port_free`` (the API's) and ``check_free`` share one probe (``ports.check_bindable``)."""
    with pytest.raises(RuntimeError, match=r"^--openai-address 10\.255\.255\.1 is not an address of this machine"):
        check_port_free("10.255.255.1", 28953)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"^OpenAI API port 127.0.0.1:{taken} is not free .*--openai-port"):
            check_port_free("127.0.0.1", taken)


def test_listens_on_tells_the_process_holding_a_port_from_another():
    """The launcher's readiness asks whether its own tritonserver holds the HTTP port: another server answering on
    it (two launchers started at once) is not its server ready."""
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", 0))
        mine.listen()
        port = mine.getsockname()[1]
        assert listens_on(os.getpid(), port) is True
        other = subprocess.Popen([sys.executable, "-c", "import socket, sys; s = socket.socket(); "
                                  "s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True); "
                                  "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            theirs = int(other.stdout.readline())
            assert listens_on(os.getpid(), theirs) is False and listens_on(other.pid, theirs) is True
        finally:
            other.communicate("", timeout=30)
    assert listens_on(os.getpid(), port) is False  # closed
