"""InternVL3 served end to end: ``internvl3_tiny`` (fp32, seeded dummy weights) started from
deploy/internvl3_tiny_cpu.yaml plus ``--set '*.preset=internvl3_tiny'`` (the launcher's own plan), through a real
tritonserver; greedy streamed tokens equal transformers' ``InternVLForConditionalGeneration.generate()`` on the same
weights and processor-equal pixels for text, one image, several images and a video, over KServe gRPC and the
OpenAI API; bad input is refused naming the problem and the server keeps serving.

One server for the module (the tiny model loads in seconds on the CPU); every media item here is made for this
module, so no cache of the shared Qwen server is involved."""
from __future__ import annotations

import argparse
import base64
import json
import struct
import zlib

import openai
import pytest

from backends.runtime.loader import ModelSpec, load_model
from backends.triton import launch_options
from backends.triton.launcher import REPO_ROOT
from backends.triton.repository import REPOSITORY
from client.api import Client, ServerError
from orchestrator.sampling_params import RequestParams, parse_sampling_parameters
from tests.e2e.conftest import openai_sdk, repository_with, serve
from tests.media import make_image, make_video
from tests.reference import assert_same_or_tie, server_request_reference

pytestmark = pytest.mark.e2e
N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
QUESTION = "Describe what you see, briefly."
PRESET = "internvl3_tiny"
# a 3:1 image: 3 tiles and a thumbnail (1024 tokens); a 5:4 one: 1 tile (256); a 12-frame clip: 8 segments (2048)
WIDE, SQUARE = make_image(690, 230, "RGB", "PNG"), make_image(250, 200, "RGB", "PNG")
CLIP = make_video(None, 88, 72, 12, 10)


@pytest.fixture(scope="module")
def internvl_server(media_dir, tmp_path_factory):
    args = argparse.Namespace(config=REPO_ROOT / "deploy" / "internvl3_tiny_cpu.yaml", model=None, gpu_sharing=None,
                              chat_template=None, chat_template_content_format=None,
                              overrides=[f"*.preset={PRESET}"])
    plan = launch_options.serve_plan(args, REPOSITORY)
    assert {models.get("preset") for models in plan.overrides.values()} >= {PRESET}
    repository = repository_with(tmp_path_factory.mktemp("internvl3") / "repository", plan.overrides)
    with serve(media_dir, repository) as server:
        yield server


@pytest.fixture(scope="module")
def client(internvl_server):
    with Client(f"127.0.0.1:{internvl_server.ports.grpc}") as c:
        yield c


@pytest.fixture(scope="module")
def hf():
    """The model the server runs (preset internvl3_tiny, seed 0, float32; the deployment puts every stage on the
    CPU), in this process."""
    return load_model(ModelSpec(preset=PRESET, device="cpu"))


@pytest.mark.parametrize("media", [
    {},
    {"image": WIDE},
    {"images": (SQUARE, WIDE)},
    {"video": CLIP},
], ids=["text", "one image", "several images", "video"])
def test_streamed_tokens_equal_transformers_generate(client, hf, media):
    reference = server_request_reference(*hf, QUESTION, N, **media)
    images = media.get("images") or ([media["image"]] if "image" in media else None)
    # 4N tokens, the first N held to the reference: a send lane that falls behind merges a request's queued tokens
    # into one response, so that the whole reply in one response takes a lane held up through 4N - 1 decode steps
    result = client.generate(QUESTION, image=images, video=media.get("video"),
                             sampling={**GREEDY, "max_tokens": 4 * N}, return_output_ids=True)
    # streamed: a response per token, except where a token ends inside a UTF-8 character (held for the next)
    assert result.finish_reason == "length" and len(result.token_ids) == 4 * N and 1 < result.num_responses <= 4 * N
    visual = {"": 0, "image": 1024, "images": 256 + 1024, "video": 8 * 256}[next(iter(media), "")]
    assert result.num_input_tokens > visual
    assert_same_or_tie(result.token_ids[:N], *reference)  # greedy: the N-token reply's


def test_num_frames_and_tile_settings_set_the_plan(client, hf):
    """A request's num_frames and tile settings reach the family's plan (3 segments; 1 tile, no thumbnail; 4 x 4 tiles
    and a thumbnail, above the checkpoint's 12, as transformers' max_patches; transformers' min_patches 2 makes a
    square's 1 tile 2 x 2 and a thumbnail; dynamic_image_size false, one tile whatever min_tiles says, vLLM's rule);
    a clip of fewer frames than the default 8 segments gives each of its 5 (case C3; the processor would refuse it)."""
    text_only = client.generate(QUESTION, sampling=GREEDY).num_input_tokens
    clip, image, short = make_video(None, 80, 64, 9, 10), make_image(660, 200, "RGB", "PNG"), \
        make_video(None, 56, 40, 5, 10)
    for media, setting, tiles in (({"video": clip}, {"num_frames": 3}, 3), ({"image": image}, {"max_tiles": 1}, 1),
                                  ({"image": make_image(1792, 1792, "RGB", "PNG")}, {"max_tiles": 16}, 17),
                                  ({"image": make_image(300, 300, "RGB", "PNG")}, {"min_patches": 2}, 5),
                                  ({"image": image}, {"dynamic_image_size": False, "min_tiles": 4}, 1),
                                  ({"video": short}, {}, 5)):
        result = client.generate(QUESTION, sampling={**GREEDY, **setting}, return_output_ids=True, **media)
        assert tiles * 256 < result.num_input_tokens - text_only < (tiles + 1) * 256
        params = parse_sampling_parameters(json.dumps(setting))
        assert_same_or_tie(result.token_ids, *server_request_reference(*hf, QUESTION, N, **media, params=params))


def test_a_video_partly_evicted_from_the_prefix_cache_is_decoded_from_its_first_uncached_frame(client, hf):
    """A video whose last KV pages another request's prompt evicted (the pool: 2048 pages of 16 tokens), asked about
    again: its cached start is shared, FlashCodec decodes only the frames after it, and the tokens equal the
    reference (a partial hit once crashed the engine for InternVL3, whose groups are single frames)."""
    first, big = make_video(None, 88, 72, 60, 10), make_video(None, 80, 64, 110, 10)
    settings = {**GREEDY, "num_frames": 60}  # about 15,800 prompt tokens, 990 pages
    client.generate(QUESTION, video=first, sampling=settings)
    client.generate(QUESTION, video=big, sampling={**GREEDY, "num_frames": 110})  # about 1,800 pages: evicts
    again = client.generate(QUESTION, video=first, sampling=settings, return_output_ids=True)
    assert 0 < again.num_cached_tokens < again.num_input_tokens - 256  # part of it, at least a frame short
    assert_same_or_tie(again.token_ids, *server_request_reference(*hf, QUESTION, N, video=first,
                                                                  params=RequestParams(num_frames=60)))
    assert client.generate(QUESTION, sampling=GREEDY).finish_reason == "length"  # the pool is whole again


def _zero_width_png() -> bytes:
    """A PNG whose header says 0 x 8 pixels (a valid chunk CRC): Pillow will not open it."""
    png = make_image(8, 8, "RGB", "PNG")
    at = png.index(b"IHDR")
    header = png[at:at + 4] + struct.pack(">I", 0) + png[at + 8:at + 17]
    return png[:at] + header + struct.pack(">I", zlib.crc32(header)) + png[at + 21:]


BAD = [
    # (what, request kwargs, words the error must contain)
    ("a zero-width image", dict(image=_zero_width_png()), ["image: not a decodable image"]),
    ("num_frames 0", dict(sampling={"num_frames": 0}), ["sampling_parameters: num_frames must be in [1, 1024], got 0"]),
    ("max_pixels, a Qwen2.5-VL setting", dict(sampling={"max_pixels": 200704}),
     ["max_pixels does not apply to the served model family internvl3"]),
    ("min_pixels, a Qwen2.5-VL setting", dict(sampling={"min_pixels": 200704}),
     ["min_pixels does not apply to the served model family internvl3"]),
]


@pytest.mark.parametrize("what,kwargs,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_named_and_the_server_keeps_serving(client, what, kwargs, words):
    kwargs = dict(kwargs)
    with pytest.raises(ServerError) as error:
        client.generate(QUESTION, sampling={**GREEDY, "max_tokens": 2, **kwargs.pop("sampling", {})}, **kwargs)
    assert all(w in str(error.value) for w in words), f"{what}: {error.value}"
    assert client.generate("Hi", sampling={**GREEDY, "max_tokens": 2}).num_output_tokens == 2


@pytest.fixture(scope="module")
def sdk(internvl_server, tmp_path_factory):
    with openai_sdk(internvl_server, tmp_path_factory.mktemp("openai")) as client:
        yield client


def test_openai_api_serves_it(sdk, hf):
    """The chat route with an image (a data URL) gives transformers' tokens; a bad setting is an HTTP 400 naming it
    (a min_tiles, here under transformers' name, above the checkpoint's 12 tiles: both values)."""
    image = make_image(300, 420, "RGB", "PNG")
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    assert [m.id for m in sdk.models.list().data] == [PRESET]
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    reply = sdk.chat.completions.create(model=PRESET, messages=[{"role": "user", "content": content}],
                                        max_tokens=N, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert_same_or_tie(reply.choices[0].token_ids, *server_request_reference(*hf, QUESTION, N, image=image))
    with pytest.raises(openai.BadRequestError, match="num_frames must be in"):
        sdk.chat.completions.create(model=PRESET, messages=[{"role": "user", "content": QUESTION}], max_tokens=2,
                                    extra_body={"mm_processor_kwargs": {"num_frames": 0}})
    with pytest.raises(openai.BadRequestError, match=r"mm_processor_kwargs.min_tiles 13 and max_tiles 12 \(the "):
        sdk.chat.completions.create(model=PRESET, messages=[{"role": "user", "content": content}], max_tokens=2,
                                    extra_body={"mm_processor_kwargs": {"min_patches": 13}})


def test_structured_outputs_and_several_choices_hold_for_this_family(sdk):
    """InternVL3's tokenizer and vocabulary under a JSON schema, n=2 with an image: JSON that fits it, each choice
    (without free whitespace: the dummy model would fill the reply with it)."""
    image = make_image(200, 140, "RGB", "PNG")
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    reply = sdk.chat.completions.create(
        model=PRESET, n=2, max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "Which colour?"}]}],
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    assert [c.finish_reason for c in reply.choices] == ["stop", "stop"], [c.message.content for c in reply.choices]
    assert all(json.loads(c.message.content)["colour"] in ("red", "blue") for c in reply.choices)
