"""The peer benchmark's images are fresh to every cache (bench/peer/scenarios.py, ``distinct_image``): the 2026-12-03
lease found 13 of images16's 16 images in UnifiedServe's encoder cache (mixed_images had sent the same frames) and
the goodput test's unloaded pass timing a repeat served from it (29 ms against 130 ms cold)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from bench.peer import scenarios
from bench.peer.load import ChatRequest
from bench.serve_bench import SMOKE_SETUP


def frames(tmp_path: Path, count: int = 4, size: tuple[int, int] = (160, 90)) -> tuple[Path, ...]:
    rng = np.random.default_rng(0)
    paths = []
    for k in range(count):
        path = tmp_path / f"f{k}.jpg"
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path, quality=90)
        paths.append(path)
    return tuple(paths)


def inputs(tmp_path: Path) -> scenarios.Inputs:
    images = frames(tmp_path)
    sizes = {(160, 90): images, (320, 180): frames(tmp_path / "big", size=(320, 180))}
    return scenarios.Inputs(SMOKE_SETUP, tmp_path / "v.mp4", tmp_path / "v.mp4", images, sizes, None, ())


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def image_paths(requests: list[ChatRequest]) -> list[str]:
    return [part["image_url"]["url"] for r in requests for part in r.parts if part["type"] == "image_url"]


def test_a_marked_image_keeps_its_size_has_other_pixels_and_is_built_once(tmp_path):
    (tmp_path / "big").mkdir()
    image = frames(tmp_path, 1)[0]
    first, again, other = (scenarios.distinct_image(image, key) for key in ("a", "a", "b"))
    assert first == again and first != other and first.parent == image.parent
    assert Image.open(first).size == Image.open(image).size == (160, 90)
    stamp = first.stat().st_mtime_ns
    assert scenarios.distinct_image(image, "a").stat().st_mtime_ns == stamp  # not built again
    corner = np.s_[:32, :64]
    assert not np.array_equal(pixels(first)[corner], pixels(other)[corner])
    assert not np.array_equal(pixels(first)[corner], pixels(image)[corner])


def test_goodput_and_unloaded_requests_never_send_one_image_twice(tmp_path):
    (tmp_path / "big").mkdir()
    given = inputs(tmp_path)
    unloaded = scenarios.unloaded_requests("images", given, "goodput_images@unloaded")
    loaded = scenarios.goodput_requests("images", given, 12, 0, "goodput_images@2")
    other_rate = scenarios.goodput_requests("images", given, 12, 0, "goodput_images@4")
    urls = image_paths(unloaded) + image_paths(loaded) + image_paths(other_rate)
    assert len(urls) == len(set(urls))
    assert len(unloaded) == 4 * scenarios.UNLOADED_REPEATS  # 1 or 2 images of two sizes
    assert [r.kind for r in unloaded[:4]] == [r.kind for r in unloaded[4:]]
    # the same seed draws the same workload at every rate: only the images' marks differ
    assert [(r.kind, r.max_tokens) for r in loaded] == [(r.kind, r.max_tokens) for r in other_rate]


def test_the_video_workloads_unloaded_pass_repeats_its_request():
    given = scenarios.Inputs(SMOKE_SETUP, Path("v.mp4"), Path("long.mp4"), (), {}, None, ())
    requests = scenarios.unloaded_requests("long_video", given, "goodput_long_video@unloaded")
    assert [r.kind for r in requests] == ["long_video"] * scenarios.UNLOADED_REPEATS
    assert all(r.max_tokens == scenarios.OUTPUT_TOKENS[0] for r in requests)


def test_cold_scenarios_name_their_media_anew_on_every_send_and_the_cache_scenarios_do_not(tmp_path):
    (tmp_path / "big").mkdir()
    given = inputs(tmp_path)
    video = scenarios.video_request(Path("v.mp4"), 8)
    first, again = (part["uuid"] for body in (video.body("m"), video.body("m"))
                    for part in body["messages"][-1]["content"] if part["type"] == "video_url")
    assert first != again  # text_c1-style repeats of one request object are new media to vLLM too
    image = scenarios.goodput_requests("images", given, 1, 0, "goodput_images@2")[0].body("m")
    assert all("uuid" in p for p in image["messages"][-1]["content"] if p["type"] == "image_url")
    assert all("uuid" not in p for p in image["messages"][-1]["content"] if p["type"] == "text")
    followup = scenarios.ChatRequest("followup", scenarios.chat_parts("q", videos=["file:///v.mp4"]), 8)
    assert all("uuid" not in p for p in followup.body("m")["messages"][-1]["content"])
