"""max_visual_tokens through tritonserver: a request over the cap is served with its videos' fps (then its items'
pixels) lowered, its first response says what was applied, and its tokens are those of the same request sent with
those settings; a cap that not even the lowest settings meet is refused naming it."""
from __future__ import annotations

import base64

import pytest

from client.api import Client, ServerError
from tests.e2e.conftest import repository_with, serve, wait_for_idle_pools
from tests.media import make_image, make_video

pytestmark = pytest.mark.e2e

CAP = 400  # visual tokens per request
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def capped(media_dir, tmp_path_factory):
    repository = repository_with(tmp_path_factory.mktemp("capped") / "repository",
                                 {"orchestrator": {"max_visual_tokens": str(CAP)}})
    with serve(media_dir, repository) as server, Client(f"127.0.0.1:{server.ports.grpc}") as client:
        yield server, client


def test_a_video_over_the_cap_gets_a_lower_fps_and_the_tokens_of_that_fps(capped):
    server, client = capped
    video = make_video(width=448, height=336, num_frames=60, fps=10.0)  # 6 s: 12 frames at 2 fps, 1,152 tokens
    capped_reply = client.generate("Describe.", video=video, sampling=GREEDY, return_output_ids=True, stream=True)
    cap = capped_reply.visual_cap
    assert cap is not None and cap["max_visual_tokens"] == CAP, cap
    assert cap["requested_visual_tokens"] > CAP >= cap["visual_tokens"] and 0 < cap["fps"] < 2.0
    assert cap["max_pixels"] == [None]  # fewer frames sufficed
    (media,) = capped_reply.media  # what was done: the lowered plan's, fewer than the 12 frames at 2 fps
    assert media["visual_tokens"] == cap["visual_tokens"] and media["frames"] == media["sampled_frames"] < 12
    same = client.generate("Describe.", video=video, sampling={**GREEDY, "fps": cap["fps"]}, return_output_ids=True)
    assert same.visual_cap is None  # within the cap as sent
    assert (same.token_ids, same.num_input_tokens) == (capped_reply.token_ids, capped_reply.num_input_tokens)
    wait_for_idle_pools(server)


def test_an_image_over_the_cap_is_shrunk_to_the_tokens_of_that_size(capped):
    server, client = capped
    image = make_image(1200, 900)  # about 1.4k visual tokens as sent
    reply = client.generate("What is it?", image=image, sampling=GREEDY, return_output_ids=True, stream=False)
    cap = reply.visual_cap
    assert cap is not None and cap["fps"] is None and cap["visual_tokens"] <= CAP < cap["requested_visual_tokens"]
    same = client.generate("What is it?", image=image, sampling={**GREEDY, "max_pixels": cap["max_pixels"][0]},
                           return_output_ids=True, stream=False)
    assert same.visual_cap is None and same.token_ids == reply.token_ids


def test_media_that_cannot_fit_are_refused_naming_the_cap(capped):
    """Two videos need at least 2 x 256 visual tokens (4 frames of 128 tokens each: Qwen2.5-VL's minimums)."""
    _, client = capped
    video = make_video(width=448, height=336, num_frames=60, fps=10.0)
    as_url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    with pytest.raises(ServerError, match=f"over max_visual_tokens {CAP}"):
        client.generate("Compare.", video=video, video_url=as_url, sampling=GREEDY)
