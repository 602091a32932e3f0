"""Bad input gets an error naming the problem, and the server keeps serving (docs/design.md, invariant 3)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from client.api import Client, ServerError
from tests.e2e.conftest import metrics_text, settled
from tests.media import make_image, make_video

pytestmark = pytest.mark.e2e
OK = {"max_tokens": 2, "temperature": 0}


def _tiny_video(frames: int = 8) -> bytes:
    return make_video(None, 64, 48, frames, 10)


def _truncated_png() -> bytes:
    """A 640x360 PNG cut in half: its header is whole (the probe passes), its pixels are not."""
    data = make_image(640, 360, "RGB", "PNG")
    return data[: len(data) // 2]


BAD = [
    # (what, request kwargs, words the error must contain)
    ("bytes that are not a video", dict(text="Describe.", video=b"\x00not a video" * 50), ["video"]),
    ("an image that is not an image", dict(text="Describe.", image=b"GIF89a-broken"), ["image"]),
    ("an empty prompt", dict(text="   "), ["text_input", "empty"]),
    ("an unknown sampling key", dict(text="Hi", sampling={"max_tokens": 2, "no_such_key": 1}), ["no_such_key"]),
    ("max_tokens 0", dict(text="Hi", sampling={"max_tokens": 0}), ["max_tokens"]),
    ("max_tokens negative", dict(text="Hi", sampling={"max_tokens": -3}), ["max_tokens"]),
    ("temperature negative", dict(text="Hi", sampling={"temperature": -1}), ["temperature"]),
    ("a video_url outside the allowed folders", dict(text="Hi", video_url="/etc/passwd"), ["video_url", "allowed"]),
    ("a video_url with ..", dict(text="Hi", video_url="/tmp/../etc/passwd"), ["video_url"]),
    ("an http video_url", dict(text="Hi", video_url="http://example.com/a.mp4"), ["video_url", "http"]),
    ("a prompt longer than max_model_len", dict(text="Hi", sampling={"max_tokens": 40000}), ["max_model_len"]),
    ("max_tokens beyond max_model_len on a text prompt", dict(text="Hi", sampling={"max_tokens": 10**9}),
     ["max_tokens can be at most"]),
    ("an extreme aspect ratio", dict(text="Hi", image=make_image(20000, 50, "RGB", "PNG")), ["image", "aspect"]),
    ("an empty video_url", dict(text="Hi", video_url=""), ["video_url: empty"]),
    ("an empty image_url", dict(text="Hi", image_url=[""]), ["image_url: empty"]),
    ("a video in image", dict(text="Hi", image=_tiny_video()), ["image: not a decodable image (JPEG, PNG"]),
    ("a truncated second image", dict(text="Hi", image=[make_image(64, 48), _truncated_png()]),
     ["image (item 2 of 2): truncated or corrupt"]),
    ("a second image that is a video", dict(text="Hi", image=[make_image(64, 48), _tiny_video()]),
     ["image (item 2 of 2): not a decodable image"]),
    ("max_pixels under a video's minimum", dict(text="Hi", video=_tiny_video(), sampling={**OK, "max_pixels": 100351}),
     ["sampling_parameters: max_pixels must be at least 100352"]),
    ("min_pixels above max_pixels", dict(text="Hi", image=make_image(40, 30),
                                         sampling={**OK, "min_pixels": 200704, "max_pixels": 100352}),
     ["min_pixels", "max_pixels"]),
    ("max_tiles, an InternVL3 setting", dict(text="Hi", image=make_image(40, 30), sampling={**OK, "max_tiles": 2}),
     ["sampling_parameters: max_tiles does not apply to the served model family qwen2_5_vl (got 2)"]),
    ("num_frames, an InternVL3 setting", dict(text="Hi", sampling={**OK, "num_frames": 4}),
     ["sampling_parameters: num_frames does not apply to the served model family qwen2_5_vl (got 4)"]),
]


@pytest.mark.parametrize("what,kwargs,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_named_and_the_next_request_succeeds(grpc_url, what, kwargs, words):
    kwargs = dict(kwargs)
    text = kwargs.pop("text")
    with Client(grpc_url) as client:
        with pytest.raises(ServerError) as error:
            client.generate(text, sampling=kwargs.pop("sampling", OK), **kwargs)
        message = str(error.value).lower()
        assert all(w.lower() in message for w in words), f"{what}: {error.value}"
        assert client.generate("Still there?", sampling=OK).finish_reason in ("length", "stop")


def test_errors_on_one_grpc_stream_name_their_request(grpc_url):
    """Several requests on one stream (tritonclient's start_stream): Triton 2.51 passes an error without its request's
    id, so the message names it (a fresh user's case, 2026-12-07)."""
    import queue

    import tritonclient.grpc as grpcclient

    from client.api import grpc_inputs, request_tensors

    errors: queue.Queue = queue.Queue()
    bad = {"bad-video": dict(video=b"\x00" * 5000), "bad-image": dict(image=b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)}
    with grpcclient.InferenceServerClient(grpc_url) as triton:
        triton.start_stream(callback=lambda result, error: errors.put(error))
        for request_id, media in bad.items():
            triton.async_stream_infer("orchestrator", grpc_inputs(request_tensors("Describe.", sampling=OK, **media)),
                                      request_id=request_id)
        messages = sorted(errors.get(timeout=60).message() for _ in bad)
        triton.stop_stream()
    assert messages[0].startswith("image: ") and messages[0].endswith(" [request id: bad-image]"), messages
    assert messages[1].startswith("video: ") and messages[1].endswith(" [request id: bad-video]"), messages


def test_data_url_scheme_is_case_insensitive(grpc_url):
    import base64

    url = "DATA:image/png;BASE64," + base64.b64encode(make_image(64, 48, "RGB", "PNG")).decode()
    with Client(grpc_url) as client:
        assert client.generate("Describe.", image_url=url, sampling=OK).num_output_tokens >= 1


def test_a_bad_request_does_not_disturb_a_good_one_running_beside_it(grpc_url):
    import threading

    results = {}

    def good():
        with Client(grpc_url) as client:
            results["good"] = client.generate("Describe.", video=_tiny_video(), sampling={**OK, "max_tokens": 6},
                                              timeout_s=120)

    thread = threading.Thread(target=good)
    thread.start()
    with Client(grpc_url) as client:
        for _ in range(5):
            with pytest.raises(ServerError):
                client.generate("Describe.", video=b"\x00" * 4096, sampling=OK)
    thread.join(timeout=150)
    assert results["good"].num_output_tokens >= 1


@pytest.mark.parametrize("frames, used", [(1, 1), (2, 2), (3, 2)])
def test_short_clips_are_answered(grpc_url, frames, used):
    """Case C3: fewer frames than the sampler wants: sample what exists (rounded down to the temporal patch of 2, the
    only frame of a 1-frame clip repeated), answer, and report the real count (the first response's ``media``)."""
    with Client(grpc_url) as client:
        result = client.generate("Describe.", video=_tiny_video(frames), sampling=OK)
    assert result.num_output_tokens >= 1
    (media,) = result.media
    assert media["kind"] == "video" and media["frames_in_file"] == frames and media["frames"] == used
    assert media["sampled_frames"] == 2 * media["grid_thw"][0] >= used and media["sampled_frames"] % 2 == 0
    assert media["duration_s"] == pytest.approx(frames / 10, abs=0.01)  # 10 fps: the 2-frame clip lasts 0.2 s


@pytest.mark.parametrize("size", [(1, 1), (26, 28), (27, 1000)])
def test_tiny_and_thin_images_are_resized_up(grpc_url, size):
    """Case C1: sides under the 28-px merge unit are scaled up as the reference preprocessing does."""
    with Client(grpc_url) as client:
        result = client.generate("Describe.", image=make_image(*size, "RGB", "PNG"), sampling=OK)
    assert result.num_output_tokens >= 1


def test_truncated_video_gives_frames_or_a_clear_error(grpc_url):
    """Case C4: an MP4 cut to 60% of its bytes."""
    data = make_video(None, 128, 96, 60, 10)
    with Client(grpc_url) as client:
        try:
            result = client.generate("Describe.", video=data[: int(len(data) * 0.6)], sampling=OK)
            assert result.num_output_tokens >= 1
        except ServerError as exc:
            assert any(w in str(exc).lower() for w in ("truncated", "corrupt", "video")), str(exc)
        assert client.generate("Still there?", sampling=OK).num_output_tokens >= 1


def test_too_many_visual_tokens_are_refused_from_metadata(grpc_url):
    """Case C7: 20 s of 640x360 sampled at 30 fps is ~90k visual tokens: refused before any decoding,
    with the text tokens, visual tokens and the limit in the message."""
    video = make_video(None, 640, 360, 600, 30)
    with Client(grpc_url) as client:
        with pytest.raises(ServerError) as error:
            client.generate("Describe.", video=video, sampling={**OK, "fps": 30})
        message = str(error.value)
        assert "visual tokens" in message and "text tokens" in message and "max_model_len" in message, message
        assert client.generate("Still there?", sampling=OK).num_output_tokens >= 1


def _generate_stream(http_url: str, model: str, body: bytes, content_type: str) -> str:
    """The text of Triton's HTTP ``generate_stream`` answer to ``body``, whatever its status."""
    request = urllib.request.Request(f"http://{http_url}/v2/models/{model}/generate_stream", method="POST",
                                     data=body, headers={"Content-Type": content_type})
    try:
        return urllib.request.urlopen(request, timeout=60).read().decode()
    except urllib.error.HTTPError as exc:
        return exc.read().decode()


@pytest.mark.parametrize("model,body", [
    ("decode", {"op": "stream", "token": "guess"}),
    ("flashcodec", {"op": "abort", "request_id": "x", "token": "guess"}),
])
def test_internal_models_refuse_clients(http_url, grpc_url, model, body):
    """The stages serve only the orchestrator: a client's `decode` stream must not take over the fan-out."""
    text = _generate_stream(http_url, model, json.dumps(body).encode(), "application/json")
    assert "internal to UnifiedServe" in text, text
    with Client(grpc_url) as client:
        assert client.generate("Still there?", sampling=OK, timeout_s=60).num_output_tokens >= 1


def test_a_large_body_sent_as_curl_sends_it_is_answered_not_a_crash(http_url, grpc_url):
    """Triton 2.51's HTTP front end reads a body sent as a form (curl's default Content-Type) with about twice its
    size of a thread's stack: with Linux's usual 8 MiB a 4 MiB body crashed the server. The launcher starts it
    with larger stacks (server_binary.THREAD_STACK_BYTES)."""
    body = json.dumps({"text_input": "x" * (6 << 20), "stream": True}).encode()
    text = _generate_stream(http_url, "orchestrator", body, "application/x-www-form-urlencoded")
    assert "text_input: 6291456 bytes, over the limit" in text, text
    with Client(grpc_url) as client:
        assert client.generate("Still there?", sampling=OK, timeout_s=60).num_output_tokens >= 1


def test_refused_requests_are_counted(server, grpc_url):
    """unifiedserve_request_success_total{finished_reason="invalid"}: a rate of bad requests for dashboards (sent
    once a second: orchestrator/metrics.py)."""
    def invalid() -> float:
        return sum(float(line.split()[-1]) for line in metrics_text(server).splitlines()
                   if line.startswith('unifiedserve_request_success_total{finished_reason="invalid"}'))

    before = settled(invalid)
    with Client(grpc_url) as client:
        for _ in range(2):
            with pytest.raises(ServerError, match="max_tokens"):
                client.generate("Hi", sampling={"max_tokens": 0})
    assert settled(invalid) == before + 2
