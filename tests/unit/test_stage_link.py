"""The stage link (backends/stage_link.py): calls, streamed replies, errors, a stage that goes away."""
from __future__ import annotations

import asyncio
import multiprocessing.connection
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from backends import internal_token, stage_link
from backends.shared_tensor import RUN_DIR_ENV


@pytest.fixture
def run_dir(monkeypatch):
    path = Path(tempfile.mkdtemp(prefix="link-"))  # short: a Unix socket path has at most 107 bytes
    monkeypatch.setenv(RUN_DIR_ENV, str(path))
    internal_token.internal_token.cache_clear()
    yield path
    internal_token.internal_token.cache_clear()
    shutil.rmtree(path, ignore_errors=True)


def counting(op, body, call):
    """A stage: "count" streams 0..n-1 from another thread, "fail" ends with an error, "boom" raises."""
    if op == "count":
        def run():
            for i in range(body):
                call.send(i)
            call.end()
        threading.Thread(target=run).start()
    elif op == "fail":
        call.end(body)
    elif op == "boom":
        raise KeyError("no such thing")
    elif op == "hold":  # never ends
        call.send("held")


async def collect(client, op, body=None):
    return [x async for x in client.call(op, body)]


def test_replies_stream_in_order_and_concurrent_calls_stay_apart(run_dir):
    server = stage_link.LinkServer("decode", counting)
    client = stage_link.LinkClient("decode")

    async def main():
        return await asyncio.gather(*(collect(client, "count", n) for n in (0, 1, 50, 300)))

    try:
        assert asyncio.run(main()) == [[], [0], list(range(50)), list(range(300))]
        assert not client.busy()
    finally:
        client.close()
        server.close()
    assert not Path(stage_link.address("decode")).exists()


def test_errors_end_the_call_with_the_stage_message(run_dir):
    server = stage_link.LinkServer("flashcodec", counting)
    client = stage_link.LinkClient("flashcodec")

    async def main():
        with pytest.raises(stage_link.LinkError) as bad_video:
            await collect(client, "fail", "video: no keyframe before the first sampled frame")
        with pytest.raises(stage_link.LinkError, match="flashcodec: KeyError") as raised:
            await collect(client, "boom")
        assert await collect(client, "count", 3) == [0, 1, 2]  # the link goes on
        return bad_video.value, raised.value

    try:
        bad_video, raised = asyncio.run(main())
        assert bad_video.invalid_input and not raised.invalid_input
    finally:
        client.close()
        server.close()


def test_a_stage_that_goes_away_fails_open_and_later_calls(run_dir):
    server = stage_link.LinkServer("decode_1", counting)
    client = stage_link.LinkClient("decode_1")

    async def main():
        stream = client.call("hold")
        assert await stream.__anext__() == "held"
        server.close()  # as if the stage's process ended
        with pytest.raises(stage_link.LinkError, match="closed its link"):
            await stream.__anext__()
        with pytest.raises(stage_link.LinkError, match="closed its link"):
            await collect(client, "count", 1)

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        assert not client.busy()
    finally:
        client.close()


def test_the_client_waits_for_a_stage_still_loading(run_dir):
    client = stage_link.LinkClient("flashcodec", connect_timeout_s=30)
    started: list[stage_link.LinkServer] = []
    timer = threading.Timer(0.5, lambda: started.append(stage_link.LinkServer("flashcodec", counting)))
    timer.start()
    try:
        assert asyncio.run(collect(client, "count", 2)) == [0, 1]
    finally:
        timer.join()
        client.close()
        for server in started:
            server.close()


def test_a_stage_that_never_comes_is_named(run_dir):
    client = stage_link.LinkClient("decode", connect_timeout_s=0.2)
    with pytest.raises(stage_link.LinkError, match="did not appear"):
        asyncio.run(collect(client, "count", 1))


def test_a_caller_without_the_token_is_refused_and_the_stage_keeps_serving(run_dir):
    server = stage_link.LinkServer("decode", counting)
    try:
        with pytest.raises(multiprocessing.AuthenticationError):
            multiprocessing.connection.Client(stage_link.address("decode"), family="AF_UNIX", authkey=b"guess")
        client = stage_link.LinkClient("decode")
        try:
            assert asyncio.run(collect(client, "count", 2)) == [0, 1]
        finally:
            client.close()
    finally:
        server.close()


def test_a_run_directory_too_deep_for_a_socket_is_named(monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, "/tmp/" + "d" * 120)
    with pytest.raises(ValueError, match="shorter TMPDIR"):
        stage_link.address("decode")
