"""The stage link (backends/ipc/link.py): calls, streamed replies, errors, a stage that goes away."""
from __future__ import annotations

import asyncio
import multiprocessing.connection
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from backends.ipc import link as wire
from backends.ipc.protocol import INVALID_INPUT, SERVER_FAULT, Call, StageFailure
from backends.ipc.run_dir import RUN_DIR_ENV
from backends.triton import internal_token


@dataclass(frozen=True)
class Op(Call):
    """A test call: the stage below acts on ``op`` with ``body``."""

    op: str
    body: object = None


@pytest.fixture
def run_dir(monkeypatch):
    path = Path(tempfile.mkdtemp(prefix="link-"))  # short: a Unix socket path has at most 107 bytes
    monkeypatch.setenv(RUN_DIR_ENV, str(path))
    internal_token.internal_token.cache_clear()
    yield path
    internal_token.internal_token.cache_clear()
    shutil.rmtree(path, ignore_errors=True)


def _explode():
    raise KeyError("no such class")


class Unreadable:
    """Pickles, but unpickling it raises (as a reply from another version of the code might)."""

    def __reduce__(self):
        return _explode, ()


ORDER: list[str] = []
SENT: list[bool] = []


def counting(message, call):
    """A stage: "count" streams 0..n-1 from another thread, "fail" ends with an error, "boom" raises,
    "hold" replies once and never ends, "last" ends with a payload, "note" records (op, body size) in ORDER, "bad" replies with a
    payload that will not unpickle, "late" replies after 0.5 s and records whether that was delivered."""
    op, body = message.op, message.body
    if op in ("note", "note_big"):
        ORDER.append(f"{op}:{len(body)}")
        call.end()
        return
    if op == "stall":  # a stage slow to read: its socket fills up behind this call
        ORDER.append("stall")
        time.sleep(1.0)
        call.end()
        return
    if op == "bad":
        call.send(Unreadable())
        return
    if op == "late":
        def later():
            time.sleep(0.5)
            SENT.append(call.send("late"))
        threading.Thread(target=later).start()
        return
    if op == "count":
        def run():
            for i in range(body):
                call.send(i)
            call.end()
        threading.Thread(target=run).start()
    elif op == "last":  # two payloads, the second with the end (one message)
        call.send(0)
        call.end(last=body)
    elif op == "fail":
        call.end(StageFailure(INVALID_INPUT, body))
    elif op == "boom":
        raise KeyError("no such thing")
    elif op == "hold":  # never ends
        call.send("held")


@pytest.fixture
def link(run_dir):
    """A stage serving `counting` and the orchestrator's end of its link."""
    server, client = wire.LinkServer("decode", counting), wire.LinkClient("decode")
    yield server, client
    client.close()
    server.close()


async def collect(client, op, body=None):
    return await client.request(Op(op, body))


def test_replies_stream_in_order_and_concurrent_calls_stay_apart(link):
    server, client = link

    async def main():
        return await asyncio.gather(*(collect(client, "count", n) for n in (0, 1, 50, 300)))

    assert asyncio.run(main()) == [[], [0], list(range(50)), list(range(300))]
    assert not client.busy()
    server.close()
    assert not Path(wire.address("decode")).exists()


def test_an_end_may_carry_the_last_payload(link):
    _, client = link
    assert asyncio.run(collect(client, "last", {"first_tokens": 1})) == [0, {"first_tokens": 1}]
    assert not client.busy()


def test_errors_end_the_call_with_the_stage_message(link):
    _, client = link

    async def main():
        with pytest.raises(wire.StageError) as bad_video:
            await collect(client, "fail", "video: no keyframe before the first sampled frame")
        with pytest.raises(wire.StageError, match="decode: KeyError") as raised:
            await collect(client, "boom")
        assert await collect(client, "count", 3) == [0, 1, 2]  # the link goes on
        return bad_video.value, raised.value

    bad_video, raised = asyncio.run(main())
    assert bad_video.failure == StageFailure(INVALID_INPUT, "video: no keyframe before the first sampled frame")
    assert raised.failure.kind == SERVER_FAULT and not raised.invalid_input


def test_a_message_that_is_not_a_protocol_call_is_refused(link):
    """The stage dispatches on protocol types only; anything else ends its call as a server fault."""
    _, client = link

    async def main():
        with pytest.raises(wire.StageError, match="not a protocol call: tuple") as refused:
            await client.request(("count", 3))
        assert await collect(client, "count", 1) == [0]
        return refused.value

    assert asyncio.run(main()).failure.kind == SERVER_FAULT


def test_a_stage_that_goes_away_fails_open_and_later_calls(run_dir):
    server = wire.LinkServer("decode_1", counting)
    client = wire.LinkClient("decode_1")

    async def main():
        stream = client.call(Op("hold"))
        assert await stream.__anext__() == "held"
        server.close()  # as if the stage's process ended
        with pytest.raises(wire.StageError, match="closed its link"):
            await stream.__anext__()
        with pytest.raises(wire.StageError, match="closed its link"):
            await collect(client, "count", 1)

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        assert not client.busy()
    finally:
        client.close()


def test_the_client_waits_for_a_stage_still_loading(run_dir):
    client = wire.LinkClient("flashcodec", connect_timeout_s=30)
    started: list[wire.LinkServer] = []
    timer = threading.Timer(0.5, lambda: started.append(wire.LinkServer("flashcodec", counting)))
    timer.start()
    try:
        assert asyncio.run(collect(client, "count", 2)) == [0, 1]
    finally:
        timer.join()
        client.close()
        for server in started:
            server.close()


def test_a_stage_that_never_comes_is_named(run_dir):
    client = wire.LinkClient("decode", connect_timeout_s=0.2)
    with pytest.raises(wire.StageError, match="did not appear"):
        asyncio.run(collect(client, "count", 1))


def test_a_caller_without_the_token_is_refused_and_the_stage_keeps_serving(run_dir):
    server = wire.LinkServer("decode", counting)
    try:
        with pytest.raises(multiprocessing.AuthenticationError):
            multiprocessing.connection.Client(wire.address("decode"), family="AF_UNIX", authkey=b"guess")
        client = wire.LinkClient("decode")
        try:
            assert asyncio.run(collect(client, "count", 2)) == [0, 1]
        finally:
            client.close()
    finally:
        server.close()


def test_a_run_directory_too_deep_for_a_socket_is_named(monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, "/tmp/" + "d" * 120)
    with pytest.raises(ValueError, match="shorter TMPDIR"):
        wire.address("decode")


def test_calls_leave_in_order_and_a_large_one_does_not_hold_up_the_loop(link):
    """A video's bytes are sent by the writer thread, which waits while the stage is slow to read (here 1 s),
    not the event loop; an abort made right after its decode arrives after it."""
    _, client = link
    ORDER.clear()
    big = b"x" * (64 << 20)

    async def main():
        await collect(client, "note", b"")  # connected
        ticks = []

        async def tick():
            for _ in range(20):
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.005)

        ticker = asyncio.create_task(tick())
        await asyncio.gather(collect(client, "stall"), collect(client, "note_big", big), collect(client, "note", b"abc"))
        await ticker
        return max(b - a for a, b in zip(ticks, ticks[1:]))

    longest_gap = asyncio.run(main())
    assert ORDER == ["note:0", "stall", f"note_big:{len(big)}", "note:3"]
    assert longest_gap < 0.9, longest_gap  # the loop ran on while 64 MiB waited for the stalled stage


def test_a_reader_that_fails_fails_the_calls_instead_of_leaving_them_waiting(link):
    _, client = link

    async def main():
        with pytest.raises(wire.StageError, match="reader failed"):
            await collect(client, "bad")
        with pytest.raises(wire.StageError, match="reader failed"):
            await collect(client, "count", 1)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_silent_peer_holds_up_nobody(run_dir):
    server = wire.LinkServer("decode", counting)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(wire.address("decode"))  # and never answers the challenge
    client = wire.LinkClient("decode")
    try:
        assert asyncio.run(asyncio.wait_for(collect(client, "count", 2), 30)) == [0, 1]
    finally:
        client.close()
        started = time.monotonic()
        server.close()
        silent.close()
    assert time.monotonic() - started < 8


def test_a_stage_learns_that_a_reply_was_not_delivered(run_dir):
    """flashcodec takes back a group's patch pages when its reply cannot reach the orchestrator."""
    server = wire.LinkServer("flashcodec", counting)
    client = wire.LinkClient("flashcodec")
    SENT.clear()

    async def main():
        stream = client.call(Op("late"))
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.1)
        client.close()  # the orchestrator goes away before the reply
        with pytest.raises(wire.StageError):
            await task

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        deadline = time.monotonic() + 5
        while not SENT and time.monotonic() < deadline:
            time.sleep(0.05)
        assert SENT == [False]
    finally:
        server.close()


def test_a_call_is_queued_when_it_is_made_not_when_it_is_first_read(link):
    """The engine queues a sequence's admit when its first token comes and may read the admit's end later, after
    an abort it made meanwhile: the abort must still arrive second."""
    _, client = link
    ORDER.clear()

    async def main():
        await collect(client, "note", b"")  # connected
        first, second = client.call(Op("note", b"a")), client.call(Op("note", b"bb"))
        assert [x async for x in second] == [] and [x async for x in first] == []

    asyncio.run(asyncio.wait_for(main(), 30))
    assert ORDER == ["note:0", "note:1", "note:2"]
