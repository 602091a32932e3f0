"""Helper processes for real: this file is also the helper (`python -m tests.unit.backends.ipc.test_helper_process FD
MODE`), which answers its handshake (or says why it cannot work), echoes messages, sends raw bytes, dies, or stays
silent, as MODE says. The parent side starts it, shakes hands, watches it, notices it die or miss its deadline, and
stops it."""
import os
import queue
import signal
import sys
import threading
import time

import pytest

from backends.ipc import helper_process
from backends.ipc.helper_process import (READY, HelperProcess, HelperStartError, NoInterpreter, ParentLink, close_all,
                                         handshake_all, python_executable)

MODULE = "tests.unit.backends.ipc.test_helper_process"
RAW = bytes(range(256)) * 4096  # 1 MiB, more than one socket buffer


class Watched:
    """A helper started in ``mode`` and watched: its messages in a queue, its Exit once it has gone."""

    def __init__(self, mode: str, handshake: bool = True, **watch):
        self.helper = HelperProcess(MODULE, [mode], what=f"test helper ({mode})")
        if handshake:
            self.helper.handshake(30)
        self.messages, self.exits, self.gone = queue.Queue(), [], threading.Event()
        self.ready = threading.Event()
        self.helper.watch(self.on_message, self.on_exit, on_ready=self.ready.set, name=f"watch-{mode}", **watch)

    def on_message(self, message):
        if message[0] == "raw":
            data = bytearray(message[1])
            self.helper.recv_raw_into(memoryview(data))
            message = ("raw", bytes(data))
        self.messages.put(message)

    def on_exit(self, exit):
        self.exits.append(exit)
        self.gone.set()

    def exit(self, timeout_s: float = 20.0):
        assert self.gone.wait(timeout_s), "the watch did not see the helper go"
        assert len(self.exits) == 1
        return self.exits[0]


def test_a_helper_starts_answers_and_stops():
    watched = Watched("echo")
    helper = watched.helper
    try:
        assert helper.alive and helper.returncode is None
        helper.send({"a": [1, 2]})
        assert watched.messages.get(timeout=20) == ("echo", {"a": [1, 2]})
        helper.send(len(RAW))  # raw bytes after a message, straight into the parent's buffer
        assert watched.messages.get(timeout=20) == ("raw", RAW)
    finally:
        helper.close(10)
    exit = watched.exit()
    assert exit.code == 0 and not exit.timed_out and str(exit) == "exited (code 0)"
    assert not helper.alive and helper.returncode == 0
    helper.close(10)  # idempotent


def test_a_helper_that_cannot_work_says_why():
    helper = HelperProcess(MODULE, ["fail"], what="test helper")
    try:
        with pytest.raises(HelperStartError,
                           match=r"^test helper did not start: \('failed', 'RuntimeError: no device here'\)$"):
            helper.handshake(30)
    finally:
        helper.close()


def test_no_interpreter_or_one_that_exits_is_a_start_error(monkeypatch):
    def none():
        raise NoInterpreter("no python3 interpreter found for the helper processes")

    monkeypatch.setattr(helper_process, "python_executable", none)
    with pytest.raises(HelperStartError, match="did not start: NoInterpreter: no python3"):
        HelperProcess(MODULE, ["echo"])
    monkeypatch.setattr(helper_process, "python_executable", lambda: "/bin/false")
    helper = HelperProcess(MODULE, ["echo"], what="false")
    try:
        start = time.monotonic()
        with pytest.raises(HelperStartError, match=r"^false did not start: None$"):
            helper.handshake(30)
        assert time.monotonic() - start < 10  # its end of the socket closed: seen at once, not at the timeout
    finally:
        helper.close()


def test_a_handshake_that_never_comes_times_out():
    helpers = [HelperProcess(MODULE, ["echo"]), HelperProcess(MODULE, ["mute"], what="mute")]
    try:
        start = time.monotonic()
        with pytest.raises(HelperStartError, match="mute did not start: None"):
            handshake_all(helpers, 3.0)
        assert 2.5 < time.monotonic() - start < 10
    finally:
        close_all(helpers)
    assert all(h.returncode is not None for h in helpers)


def test_the_handshake_can_come_on_the_watch():
    watched = Watched("echo", handshake=False, handshake_s=30)
    try:
        assert watched.ready.wait(20)
        watched.helper.send("after the handshake")
        assert watched.messages.get(timeout=20) == ("echo", "after the handshake")
    finally:
        watched.helper.close(10)
    failed = Watched("fail", handshake=False, handshake_s=30)
    exit = failed.exit()
    assert not failed.ready.is_set() and exit.code != 0
    assert "did not start: ('failed', 'RuntimeError: no device here')" in exit.error


@pytest.mark.parametrize("how", ["killed", "exits"])
def test_a_helper_that_dies_is_noticed(how):
    watched = Watched("die")
    helper = watched.helper
    try:
        if how == "killed":
            os.kill(helper.pid, signal.SIGKILL)
        else:
            helper.send("die")  # it exits with code 3 on its next message
        exit = watched.exit()
        assert exit.code == (-signal.SIGKILL if how == "killed" else 3) and not exit.timed_out
        assert not helper.alive and helper.exit is exit
        with pytest.raises(OSError):
            helper.send("anyone there?")
    finally:
        helper.close()


def test_a_helper_past_its_deadline_is_killed():
    watched = Watched("silent")
    helper = watched.helper
    try:
        helper.send("a job it never answers")
        start = time.monotonic()
        helper.deadline = start + 1.0
        exit = watched.exit()
        assert exit.timed_out and exit.code == -signal.SIGKILL and str(exit) == "timed out"
        assert 0.9 < time.monotonic() - start < 1.0 + 2 * helper_process.WATCH_SLICE_S + 5
    finally:
        helper.close()


def test_a_message_that_does_not_unpickle_stops_the_helper():
    watched = Watched("garbage")
    try:
        exit = watched.exit()
        assert exit.code == -signal.SIGKILL and "UnpicklingError" in exit.error
    finally:
        watched.helper.close()


def test_a_helper_ends_when_its_parent_end_closes():
    helper = HelperProcess(MODULE, ["orphan"])
    try:
        helper.handshake(30)
        helper.conn.close()
        helper.raw.close()  # as when the parent dies: the kernel closes its end
        assert helper.wait(20) and helper.returncode == 1
    finally:
        helper.kill()
        helper.wait()


def test_the_interpreter_is_a_python():
    path = python_executable()
    assert os.access(path, os.X_OK) and os.path.basename(path).startswith("python")
    assert READY == ("ready", tuple(sys.version_info[:2]))


def no_device():
    raise RuntimeError("no device here")


def serve(fd: int, mode: str) -> None:
    """The helper: see the module's docstring."""
    parent = ParentLink(fd)
    if mode == "fail":
        parent.start(no_device)  # sends the error, then raises it: the helper exits
    if mode == "mute":
        time.sleep(60)
        return
    if mode == "orphan":
        parent.exit_with_parent()
        parent.ready()
        time.sleep(60)
        return
    parent.ready()
    if mode == "garbage":
        parent.conn.send_bytes(b"not a pickle")
        time.sleep(60)
        return
    while (message := parent.receive()) is not None:
        if mode == "die":
            os._exit(3)
        if mode == "silent":
            continue
        if isinstance(message, int):
            parent.send(("raw", message))
            parent.send_raw(RAW[:message])
        else:
            parent.send(("echo", message))


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
