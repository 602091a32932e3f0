"""The peer benchmark's scenarios and their inputs: issue 19's rows, issue 20's short requests, the goodput test.

Media are the serve bench's (``bench.serve_bench.build_media`` over ``bench.video_files``): a 3-minute 720p H.264
video and 16 JPEG frames of bigbuckbunny at 1280x720 (smoke: a 20-s 360p video, 320x180 images), plus for the
goodput test an 8-minute 720p video (smoke: the smoke video) and the 16 frames at varied sizes. Output lengths
are the serve bench's (``Setup``: video 128, images 128, text 256 tokens; smoke 32/16/32).

| scenario | what is sent |
|---|---|
| ``video`` | the 3-minute video alone |
| ``mixed_video`` | 16 closed-loop text streams; the video at 2 s; the streams stop once it has ended |
| ``mixed_images`` | 16 closed-loop text streams; 16 one-image requests at 2 s |
| ``text_c1`` | ``TEXT_C1_REQUESTS`` text requests, one after another (its TTFT is their median) |
| ``text_c32`` | 32 text requests at once |
| ``text_c32_structured`` | ``text_c32`` with every reply held to ``STRUCTURED`` (vLLM's ``structured_outputs``: the cost |
|  | of structured outputs; not in the default run) |
| ``images16`` | 16 one-image requests at once |
| ``goodput_<workload>@unloaded`` | each request type of the workload alone, ``UNLOADED_REPEATS`` times |
| ``goodput_<workload>@<rate>`` | Poisson arrivals at ``rate`` requests/s (``--requests`` of them, seeded); for |
|  | ``multiturn``: sessions/s, each session ``questions`` questions about a clip of its own, one after another |
| ``followup`` | a first question about a 3-minute video; once it has ended, a new question about the same video alone |
|  | (kind ``followup``), then as a chat: the first question, a fixed answer, the new question (``followup_chat``) |
| ``multiturn`` | ``questions`` questions about each of the ``clips`` clips, a clip's one after another (a session), |
|  | ``streams`` sessions at once (kinds ``clip<k>_q<j>``) |

Goodput workloads (each request a question with an output length drawn from 64..512 tokens): ``long_video``
(the 8-minute video), ``video`` (the 3-minute one), ``images`` (1 or 2 images of one of three sizes: six request
types, the type is the unit of the TTFT SLO), ``multiturn`` (issue 21's goodput: sessions of ``questions`` questions
about a 20-s clip, each rate and the unloaded pass on clips of their own, :func:`goodput_clip_sets`; two request
types, ``first_question`` (a cold clip) and ``later_question`` (the clip's prefix cached); run with the caches on).

With InternVL3 (``run.py --model internvl3_38b``) every video is ``bench.peer.models.INTERNVL_FRAMES`` (64) frames of
256 tokens whatever its length, so ``long_video`` counts the same 16,384 visual tokens as ``video`` (only reading its
file costs more), a multiturn clip as many; a 1280x720 image is 9 tiles (2,304 tokens), the goodput images' 640x360
3 and 1920x1080 9.

The cache scenarios (issue 21: a question again about the same media) draw on videos of their own, so that no cache
keyed by content holds them from the warm-up or another scenario (:func:`distinct_video`): ``followup`` a 3-minute
video like ``video``'s, ``multiturn`` ``clips`` clips of ``clip_seconds`` each (default 6 of 20 s at 720p: about
12,000 prompt tokens each, 71,000 in all). For the clips to outgrow a cache, make ``clips`` x the tokens of a clip
pass its size (vLLM logs its KV pool's tokens at start, "GPU KV cache size"; UnifiedServe's prefix region has its
own ceiling); ``streams`` bounds the clips in use at once, the working set a cache must hold for the later questions
to hit. The follow-up chat's assistant turn is a fixed text, not the model's answer: with dummy weights an answer is
noise, a different noise on each system; one text keeps both systems' prompts the same.
"""
from __future__ import annotations

import asyncio
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from bench.peer.load import (ChatRequest, RequestRecord, Target, chat_parts, closed_loop, media_url, open_loop,
                             poisson_times)
from bench.serve_bench import FULL_SETUP, SMOKE_SETUP, TEXT_PROMPT, Setup, build_media
from bench.video_files import build_video

QUESTION = "Describe what you see in detail."
MIXED_STREAMS = 16
MIXED_ARRIVAL_S = 2.0  # when the burst arrives beside the text streams
LONG_VIDEO = ("libx264", 1280, 720, 3_000_000, "medium", 8)  # build_video spec: 8 minutes, 720p
GOODPUT_IMAGE_SIZES = ((640, 360), (1280, 720), (1920, 1080))
OUTPUT_TOKENS = (64, 512)  # the goodput requests' output lengths, drawn uniformly
UNLOADED_REPEATS = 2
# requests/s (multiturn: sessions/s), where the H200 runs put the systems' 90% crossings: video, both served every
# request at 0.04, UnifiedServe 62.5% at 0.08 (goodput-video-2026-12-02); images, neither 90% at 2 (the seventh run)
GOODPUT_RATES = {"long_video": (0.02, 0.04, 0.06, 0.08), "video": (0.04, 0.05, 0.06, 0.08), "images": (0.5, 1, 2, 4),
                 "multiturn": (0.1, 0.2, 0.4, 0.6)}
GOODPUT_REQUESTS = {"long_video": 12, "video": 16, "images": 48, "multiturn": 8}  # per rate (multiturn: sessions)
TEXT_C1_REQUESTS = 5  # one request's TTFT is one sample: four single runs on 2026-12-02 ranged 95-145 ms
FIXED = ("video", "mixed_video", "mixed_images", "text_c1", "text_c32", "images16")
WORKLOADS = tuple(GOODPUT_RATES)
CACHED = ("followup", "multiturn")  # issue 21's, run with the systems' caches on (bench/peer/README.md)
# a regex no reply of 256 tokens can complete (Qwen's tokens of these characters are at most about 30 long), so that
# both systems make all of them under the grammar's mask, as text_c32 makes them without one
STRUCTURED = {"regex": "[a-z ,.]{8000}"}
FEATURES = ("text_c32_structured",)  # run by name, as the cache scenarios
QUESTIONS = (QUESTION, "What happens first in this clip?", "Which animals appear, and what do they do?",
             "Describe the setting, its colours and its light.", "What is the mood of the scene, and why?",
             "What happens last in this clip?")  # the multiturn scenario's, in order; the follow-up's is QUESTIONS[-1]
FOLLOWUP_ANSWER = ("A big grey rabbit walks out of his burrow into a sunny meadow, stretches, smells a flower and "
                   "watches a butterfly, while three small rodents watch him from a tree.")
MULTITURN_CLIPS = 6
MULTITURN_QUESTIONS = 4
MULTITURN_STREAMS = 3
CLIP_SECONDS = 20  # build_video's lengths are multiples of its 20-s base clip
DISTINCT_KBPS = 8  # the bit rate step (kb/s) between distinct encodings of one video spec


@dataclass(frozen=True)
class Inputs:
    """The media every scenario draws from (paths under the folder both servers may read)."""

    setup: Setup
    video: Path
    long_video: Path
    images: tuple[Path, ...]
    goodput_images: dict[tuple[int, int], tuple[Path, ...]]
    followup_video: Path | None  # the cache scenarios' media: None and () unless built (build_inputs' cache_media)
    clips: tuple[Path, ...]
    goodput_clips: dict[str, tuple[Path, ...]] = field(default_factory=dict)  # multiturn goodput's (goodput_clip_sets)


def build_inputs(media: Path, smoke: bool, clips: int = MULTITURN_CLIPS, clip_seconds: int = CLIP_SECONDS,
                 cache_media: bool = True, goodput_sessions: int = 0) -> Inputs:
    """Build (or reuse, when already there) the media in ``media``: a few minutes on first use for the full set;
    with ``cache_media``, the cache scenarios' too: the follow-up's video and ``clips`` clips of ``clip_seconds`` s
    (a multiple of 20) for the multiturn scenario (a lease that runs neither need not build them); with
    ``goodput_sessions``, the multiturn goodput's clip sets of that many sessions a rate (:func:`goodput_clip_sets`)."""
    setup = SMOKE_SETUP if smoke else FULL_SETUP
    video, images = build_media(media, setup)
    long_video = video if smoke else build_video(media, "bunny_720p_480s", LONG_VIDEO)
    sizes = ((160, 90), (320, 180), (480, 270)) if smoke else GOODPUT_IMAGE_SIZES
    resized = {size: tuple(_resized(p, size) for p in images) for size in sizes}
    clip = (*setup.video[:-1], clip_seconds / 60)
    jobs: list[tuple[tuple, int]] = []  # (build_video spec, distinct_video step)
    if cache_media:
        jobs += [(setup.video, 1)] + [(clip, 2 + k) for k in range(clips)]
    sets = goodput_clip_sets(goodput_sessions) if goodput_sessions else {}
    jobs += [(clip, k) for ks in sets.values() for k in ks]
    built: dict[int, Path] = {}
    if jobs:  # one x264 encode each (a 20-s 720p one took 18 s on 2 cores; 17 took 90 s on 16): in processes
        with ProcessPoolExecutor(max(1, min(len(jobs), (os.cpu_count() or 1) // 2))) as pool:
            built = dict(zip([k for _, k in jobs], pool.map(distinct_video, [media] * len(jobs), *zip(*jobs))))
    return Inputs(setup, video, long_video, tuple(images), resized, built.get(1),
                  tuple(built[k] for k in range(2, 2 + clips)) if cache_media else (),
                  {name: tuple(built[k] for k in ks) for name, ks in sets.items()})


def goodput_clip_sets(sessions: int) -> dict[str, tuple[int, ...]]:
    """The multiturn goodput's clips, as :func:`distinct_video` steps: ``UNLOADED_REPEATS`` for the unloaded pass
    (key ``unloaded``) and ``sessions`` for each default rate (key ``str(rate)``), each clip its own step. The steps
    are negative (bit rates below the base), so they never meet the follow-up's and multiturn's (1 and up)."""
    names = ["unloaded"] * UNLOADED_REPEATS + [str(r) for r in GOODPUT_RATES["multiturn"] for _ in range(sessions)]
    sets: dict[str, tuple[int, ...]] = {}
    for k, name in enumerate(names, start=1):
        sets[name] = (*sets.get(name, ()), -k)
    return sets


def distinct_video(media: Path, spec: tuple, k: int) -> Path:
    """``spec``'s video (a ``build_video`` spec) encoded at ``k`` x ``DISTINCT_KBPS`` kb/s more: the same size,
    length and prompt tokens, other pixels and bytes, so that no cache keyed by content holds it from the requests
    about another. Built in ``media`` on first use."""
    codec, width, height, rate, preset, minutes = spec
    rate += k * DISTINCT_KBPS * 1000
    return build_video(media, f"bunny_{height}p_{round(minutes * 60)}s_{rate // 1000}k",
                       (codec, width, height, rate, preset, minutes))


def _resized(image: Path, size: tuple[int, int]) -> Path:
    path = image.with_name(f"{image.stem}_{size[0]}x{size[1]}.jpg")
    if not path.exists():
        Image.open(image).resize(size, Image.BICUBIC).save(path, quality=90)
    return path


def text_request(inputs: Inputs, max_tokens: int | None = None, extra: tuple = ()) -> ChatRequest:
    return ChatRequest("text", chat_parts(TEXT_PROMPT), max_tokens or inputs.setup.text_tokens, extra=extra)


def image_request(path: Path, max_tokens: int) -> ChatRequest:
    return ChatRequest("image", chat_parts(QUESTION, images=[media_url(path)]), max_tokens)


def video_request(path: Path, max_tokens: int, kind: str = "video") -> ChatRequest:
    return ChatRequest(kind, chat_parts(QUESTION, videos=[media_url(path)]), max_tokens)


async def mixed(target: Target, inputs: Inputs, burst: list[ChatRequest]) -> list[RequestRecord]:
    """``MIXED_STREAMS`` closed-loop text streams; ``burst`` sent together at ``MIXED_ARRIVAL_S``; the streams
    stop once the whole burst has ended. Records: the burst's, then the streams'."""
    stop, start = asyncio.Event(), time.perf_counter()

    async def arrive() -> list[RequestRecord]:
        try:
            return await open_loop(target, [(MIXED_ARRIVAL_S, r) for r in burst], start)
        finally:
            stop.set()

    streams, arrived = await asyncio.gather(
        closed_loop(target, MIXED_STREAMS, text_request(inputs), stop, start), arrive())
    return arrived + streams


async def followup(target: Target, inputs: Inputs) -> list[RequestRecord]:
    """The ``followup`` scenario, one request after another: the first question (kind ``first``) about
    ``inputs.followup_video``, a new question about it alone (``followup``), then the chat of the first question,
    ``FOLLOWUP_ANSWER`` and the new question (``followup_chat``)."""
    url, tokens = media_url(inputs.followup_video), inputs.setup.video_tokens
    first = ChatRequest("first", chat_parts(QUESTION, videos=[url]), tokens)
    alone = ChatRequest("followup", chat_parts(QUESTIONS[-1], videos=[url]), tokens)
    chat = ChatRequest("followup_chat", chat_parts(QUESTIONS[-1]), tokens, history=(
        {"role": "user", "content": list(first.parts)}, {"role": "assistant", "content": FOLLOWUP_ANSWER}))
    return await closed_loop(target, 1, [first, alone, chat])


def multiturn_sessions(inputs: Inputs, questions: int, clips: tuple[Path, ...] | None = None, by_type: bool = False
                       ) -> list[tuple[ChatRequest, ...]]:
    """Per clip of ``clips`` (default ``inputs.clips``) the first ``questions`` of ``QUESTIONS`` about it, in order
    (kind ``clip<k>_q<j>``, or with ``by_type`` ``first_question`` / ``later_question``). Raises ValueError for more
    questions than ``QUESTIONS`` holds."""
    if not 1 <= questions <= len(QUESTIONS):
        raise ValueError(f"{questions} questions per clip: 1 to {len(QUESTIONS)}")

    def kind(k: int, j: int) -> str:
        return ("later_question" if j else "first_question") if by_type else f"clip{k}_q{j}"
    return [tuple(ChatRequest(kind(k, j), chat_parts(q, videos=[media_url(clip)]), inputs.setup.video_tokens)
                  for j, q in enumerate(QUESTIONS[:questions]))
            for k, clip in enumerate(inputs.clips if clips is None else clips)]


def goodput_requests(workload: str, inputs: Inputs, count: int, seed: int) -> list[ChatRequest]:
    """``count`` requests of ``workload`` with seeded output lengths (and image counts and sizes)."""
    rng = random.Random(seed)
    requests = []
    for k in range(count):
        max_tokens = rng.randint(*OUTPUT_TOKENS)
        if workload == "images":
            size = rng.choice(sorted(inputs.goodput_images))
            n = rng.randint(1, 2)
            urls = [media_url(p) for p in rng.sample(inputs.goodput_images[size], n)]
            requests.append(ChatRequest(f"{n}x{size[0]}x{size[1]}", chat_parts(QUESTION, images=urls), max_tokens))
        else:
            requests.append(video_request(inputs.long_video if workload == "long_video" else inputs.video,
                                          max_tokens, workload))
    return requests


def unloaded_requests(workload: str, inputs: Inputs) -> list[ChatRequest]:
    """One request of each type of ``workload``, ``UNLOADED_REPEATS`` times over, with the shortest output."""
    if workload != "images":
        kinds = [goodput_requests(workload, inputs, 1, 0)[0]]
    else:
        kinds = [ChatRequest(f"{n}x{w}x{h}", chat_parts(QUESTION, images=[media_url(p) for p in paths[:n]]), 0)
                 for (w, h), paths in sorted(inputs.goodput_images.items()) for n in (1, 2)]
    return [ChatRequest(r.kind, r.parts, OUTPUT_TOKENS[0]) for r in kinds] * UNLOADED_REPEATS


async def run(name: str, target: Target, inputs: Inputs, requests: int | None = None, seed: int = 0,
              questions: int = MULTITURN_QUESTIONS, streams: int = MULTITURN_STREAMS) -> list[RequestRecord]:
    """Run scenario ``name`` (a row of the module's table) against ``target``; returns its records. ``requests``
    and ``seed``: the goodput runs'; ``questions`` per clip and ``streams`` (sessions at once): multiturn's. Raises
    ValueError for an unknown name."""
    s = inputs.setup
    if name == "video":
        return await open_loop(target, [(0.0, video_request(inputs.video, s.video_tokens))])
    if name == "mixed_video":
        return await mixed(target, inputs, [video_request(inputs.video, s.video_tokens)])
    if name == "mixed_images":
        return await mixed(target, inputs, [image_request(p, s.image_tokens) for p in inputs.images])
    if name == "text_c1":
        return await closed_loop(target, 1, [text_request(inputs)] * TEXT_C1_REQUESTS)
    if name == "text_c32":
        return await open_loop(target, [(0.0, text_request(inputs))] * 32)
    if name == "text_c32_structured":
        return await open_loop(target, [(0.0, text_request(inputs, extra=(("structured_outputs", STRUCTURED),)))] * 32)
    if name == "images16":
        return await open_loop(target, [(0.0, image_request(p, s.image_tokens)) for p in inputs.images])
    if name == "followup":
        return await followup(target, inputs)
    if name == "multiturn":
        return await closed_loop(target, streams, multiturn_sessions(inputs, questions))
    workload, _, rate = name.removeprefix("goodput_").partition("@")
    if not name.startswith("goodput_") or workload not in WORKLOADS or not rate:
        raise ValueError(f"unknown scenario {name!r}: one of {FIXED + CACHED + FEATURES} or "
                         f"goodput_<{'|'.join(WORKLOADS)}>@<rate|unloaded>")
    if workload == "multiturn":
        if rate not in inputs.goodput_clips:
            raise ValueError(f"no clips for {name!r}: prepare builds them for the rates {GOODPUT_RATES[workload]}")
        sessions = multiturn_sessions(inputs, questions, inputs.goodput_clips[rate], by_type=True)
        if rate == "unloaded":
            return await closed_loop(target, 1, sessions)
        return await open_loop(target, list(zip(poisson_times(float(rate), len(sessions), seed), sessions)))
    if rate == "unloaded":  # one at a time
        return await closed_loop(target, 1, unloaded_requests(workload, inputs))
    count = requests or GOODPUT_REQUESTS[workload]
    arrivals = poisson_times(float(rate), count, seed)
    return await open_loop(target, list(zip(arrivals, goodput_requests(workload, inputs, count, seed))))


def warmup_requests(inputs: Inputs) -> list[ChatRequest]:
    """Sent once after a start, not recorded: first-use costs (kernel builds, compilation, decoder sessions, the
    files' first reads) of the text, image and video paths. The image twice: UnifiedServe captures a vision CUDA
    graph the second time a grid is seen (``backends/runtime/vision/graphs.py``), and without the second the capture
    fell on the first scenario to send a 1280x720 image (the ninth run's ``mixed_images``: its first step's encode
    147 ms against 17 graphed), a first-use cost the scenarios' steady state does not have. With the caches off only
    (the fixed scenarios' setting): with ``--caches`` the second image is an encoder-cache hit, and the goodput
    workload's other sizes are first seen by its unloaded pass."""
    image = image_request(inputs.images[0], 4)
    return [text_request(inputs, 4), image, image, video_request(inputs.video, 4)]


WARMUP_BURST = 32  # text requests sent at once after the warm-up's one-at-a-time requests


def warmup_burst(inputs: Inputs) -> list[tuple[float, ChatRequest]]:
    """Sent at once after :func:`warmup_requests`, not recorded: a server with several API processes (UnifiedServe's
    4 on a 16-core host, each with a listening socket of its own) has the kernel spread connections over them, and
    the one-at-a-time warm-up reaches one. The others met their first requests in the first scenario's burst: every
    start's first text_c32 pass had TTFT p50 108-188 ms against 93-106 later, up to 68 ms of it in an API process's
    first response (bench/results/peer/twenty-first-run-h100-2026-12-06/README.md). 32 connections leave one of 4
    processes without a request with a chance of 4 x (3/4)^32, about 4e-4."""
    return [(0.0, text_request(inputs, 4))] * WARMUP_BURST
