"""Request validation at the Triton boundary (orchestrator/inputs.py): every problem is named."""
from __future__ import annotations

import base64

import pytest

from flashcodec.errors import NOT_AN_IMAGE
from flashcodec.files import file_stamp
from flashcodec.sampling import VIDEO_MIN_PIXELS
from orchestrator.inputs import InputLimits, MediaInput, RawRequest, parse_request
from orchestrator.media import plan_media
from orchestrator.prompt import QWEN
from orchestrator.sampling_params import InvalidInput, RequestParams
from tests.media import make_image, make_video


@pytest.fixture
def limits(tmp_path):
    return InputLimits(allowed_media_dirs=(tmp_path.resolve(),), max_media_bytes=1000)


def raw(**kw):
    return RawRequest(text_input=kw.pop("text_input", [b"Hi"]), **kw)


def test_good_request_with_path_and_data_url(limits, tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"x" * 10)
    data_url = "data:image/png;base64," + base64.b64encode(b"png-bytes").decode()
    parsed = parse_request(raw(video_url=[str(tmp_path / "a.mp4").encode()], image_url=[data_url.encode()],
                               stream=True), limits)
    assert [m.kind for m in parsed.media] == ["image", "video"]  # images first, as in the prompt
    assert parsed.media[0].data == b"png-bytes" and parsed.media[1].path == str(tmp_path / "a.mp4")
    assert parsed.media[1].stamp == file_stamp((tmp_path / "a.mp4").stat()) and parsed.media[0].stamp is None
    assert parsed.stream and parsed.params.max_tokens == 16


def test_each_item_of_several_is_named_with_its_place(limits, tmp_path):
    """Errors about one of several media items say which (prompt order); a lone item is named by its input alone."""
    (tmp_path / "a.mp4").write_bytes(b"x" * 10)
    data_url = ("data:image/png;base64," + base64.b64encode(b"png-bytes").decode()).encode()
    parsed = parse_request(raw(video_url=[str(tmp_path / "a.mp4").encode()], image_url=[data_url, data_url]), limits)
    assert [m.input_name for m in parsed.media] == ["image_url (item 1 of 3)", "image_url (item 2 of 3)",
                                                    "video_url (item 3 of 3)"]
    assert parse_request(raw(image_url=[data_url]), limits).media[0].input_name == "image_url"


def test_an_items_path_error_names_its_place_in_the_prompt(limits, tmp_path):
    """A path refused while the request is read names the item too, in prompt order (a conversation's placeholders
    may put a video before the images); so does a lone item's error, without a place."""
    data_url = ("data:image/png;base64," + base64.b64encode(b"png-bytes").decode()).encode()
    missing = str(tmp_path / "nothere.png").encode()
    with pytest.raises(InvalidInput, match=r"^image_url \(item 2 of 2\): no such file"):
        parse_request(raw(image=[b"\x89PNG-bytes"], image_url=[missing]), limits)
    with pytest.raises(InvalidInput, match=r"^image_url \(item 2 of 2\): '/etc/passwd' is outside"):
        parse_request(raw(image=[b"\x89PNG-bytes"], image_url=[b"/etc/passwd"]), limits)
    with pytest.raises(InvalidInput, match=r"^image_url: no such file"):
        parse_request(raw(image_url=[missing]), limits)
    video_first = ('[{"role": "user", "content": [{"type": "video"}, {"type": "image"}, {"type": "text", '
                   '"text": "Hi"}]}]').encode()
    (tmp_path / "a.mp4").write_bytes(b"x" * 10)
    with pytest.raises(InvalidInput, match=r"^image_url \(item 2 of 2\): no such file"):
        parse_request(raw(text_input=[], messages=[video_first], image_url=[missing],
                          video_url=[str(tmp_path / "a.mp4").encode()]), limits)
    with pytest.raises(InvalidInput, match=r"^image_url \(item 1 of 2\): no such file"):
        parse_request(raw(image_url=[missing, data_url]), limits)


def test_file_url_under_allowed_folder(limits, tmp_path):
    (tmp_path / "b c.mp4").write_bytes(b"x")
    parsed = parse_request(raw(video_url=[f"file://{tmp_path}/b%20c.mp4".encode()]), limits)
    assert parsed.media[0].path.endswith("b c.mp4")
    parsed = parse_request(raw(video_url=[f"file://LOCALHOST{tmp_path}/b%20c.mp4".encode()]), limits)
    assert parsed.media[0].path.endswith("b c.mp4")  # RFC 8089: "localhost" is this machine
    with pytest.raises(InvalidInput, match=r"video_url: a file URL on host 'evil.example' is not on this machine"):
        parse_request(raw(video_url=[f"file://evil.example{tmp_path}/b%20c.mp4".encode()]), limits)
    with pytest.raises(InvalidInput, match=r"^video_url: not a valid URL \(Invalid IPv6 URL\)"):  # was a 500
        parse_request(raw(video_url=[b"file://[x"]), limits)


@pytest.mark.parametrize("kwargs,words", [
    (dict(text_input=[b""]), "text_input: the prompt is empty"),
    (dict(text_input=[b"\xff\xfe"]), "not valid UTF-8"),
    (dict(text_input=[b"a", b"b"]), "expected one string"),
    (dict(video=[b""]), "empty video"),
    (dict(image=[b"\x89" * 1001]), "over the limit"),
    (dict(image=[base64.b64encode(b"\x89" * 1001)]), "image: 1001 bytes, over the limit"),  # once decoded
    (dict(image=[b"iVBORw0KGgo"]), "image: neither an image file (JPEG, PNG, WebP, ...) nor valid base64 text"),
    (dict(image=[b"not an image at all"]), "image: neither an image file"),  # ASCII bytes sent as a file
    (dict(return_logprobs=True, sampling_parameters=[b'{"logprobs": 21}']), "logprobs must be in .0, 20., got 21"),
    (dict(video_url=[b"/etc/passwd"]), "outside the allowed media folders"),
    (dict(video_url=[b"http://example.com/v.mp4"]), "http(s) URLs are not fetched"),
    (dict(image_url=[b"data:image/png,abc"]), "only base64 data: URLs"),
    (dict(image_url=[b"data:image/png;base64,@@@"]), "invalid base64"),
    (dict(video_url=[b"ftp://host/v.mp4"]), "unsupported URL scheme"),
    (dict(video_url=[b""]), "video_url: empty URL"),
    (dict(image_url=[b"  "]), "image_url: empty URL"),
    (dict(image_url=[b"DATA:image/png,abc"]), "image_url: only base64 data: URLs"),
    (dict(image_url=[b"data:image/png;base64"]), "image_url: a data: URL without the ',' before its data"),
    (dict(sampling_parameters=[b'{"max_tokens": 0}']), "max_tokens"),
])
def test_bad_inputs_are_named(limits, kwargs, words):
    with pytest.raises(InvalidInput, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_request(raw(**kwargs), limits)


def test_dotdot_cannot_escape_the_allowed_folder(limits, tmp_path):
    with pytest.raises(InvalidInput, match="outside"):
        parse_request(raw(video_url=[f"{tmp_path}/../etc/passwd".encode()]), limits)


def test_base64_text_in_video_points_to_the_url_input(limits):
    with pytest.raises(InvalidInput,
                       match=r"video: got text \(its first bytes letters, digits and spaces only\), not a video "
                             "file's bytes; base64 goes in a data: URL in 'video_url'"):
        parse_request(raw(video=[b"AAAAIGZ0eXBpc29tAAACAGlzb21pc28y\n" * 8]), limits)


@pytest.mark.parametrize("kind", ["image", "video"])
def test_a_data_url_in_a_bytes_input_points_to_the_url_input(limits, kind):
    with pytest.raises(InvalidInput, match=f"{kind}: got a data: URL; put it in '{kind}_url'"):
        parse_request(raw(**{kind: [b"data:image/png;base64,iVBORw0KGgo="]}), limits)


@pytest.mark.parametrize("wrap", [False, True])
def test_base64_text_in_image_is_the_file_as_the_vllm_backend_takes_it(wrap):
    """The vLLM backend's ``image``: the file base64-encoded (``base64.b64decode`` of the text); line breaks, as
    ``base64`` the command writes them, are allowed."""
    png = make_image(8, 6, "RGB", "PNG")
    text = base64.encodebytes(png) if wrap else base64.b64encode(png)
    assert [m.data for m in parse_request(raw(image=[text, png]), InputLimits()).media] == [png, png]


def test_return_flags_ask_for_the_vllm_backends_outputs(limits):
    parsed = parse_request(raw(return_finish_reason=True, return_num_output_tokens=True, return_logprobs=False), limits)
    assert (parsed.extra_outputs.finish_reason, parsed.extra_outputs.num_input_tokens,
            parsed.extra_outputs.num_output_tokens) == (True, False, True)
    assert parse_request(raw(), limits).extra_outputs == type(parsed.extra_outputs)()


@pytest.mark.parametrize("flags, sampling, computed", [
    ({}, b'{"logprobs": 3}', None),  # no output asks: none computed (the vLLM backend returns them only when asked)
    ({"return_logprobs": True}, None, 0),  # the sampled token's alone
    ({"return_logprobs": True}, b'{"logprobs": 3}', 3),
    ({"return_cumulative_logprob": True}, b'{"logprobs": 3}', 0),
    ({"return_logprobs": True, "return_cumulative_logprob": True}, b'{"logprobs": 2}', 2),
])
def test_log_probabilities_are_computed_where_an_output_asks(limits, flags, sampling, computed):
    parsed = parse_request(raw(sampling_parameters=[sampling] if sampling else [], **flags), limits)
    assert parsed.params.logprobs == parsed.params.sampling().logprobs == computed
    assert (parsed.extra_outputs.logprobs, parsed.extra_outputs.cumulative_logprob) == (
        flags.get("return_logprobs", False), flags.get("return_cumulative_logprob", False))


def test_missing_empty_file_and_folder_are_named(limits, tmp_path):
    with pytest.raises(InvalidInput, match="video_url: no such file: .*nope.mp4"):
        parse_request(raw(video_url=[str(tmp_path / "nope.mp4").encode()]), limits)
    with pytest.raises(InvalidInput, match="not a regular file"):
        parse_request(raw(video_url=[str(tmp_path).encode()]), limits)
    (tmp_path / "empty.mp4").write_bytes(b"")
    with pytest.raises(InvalidInput, match="video_url: empty file .0 bytes.: .*empty.mp4"):
        parse_request(raw(video_url=[str(tmp_path / "empty.mp4").encode()]), limits)


def test_limits_from_parameters_and_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("UNIFIEDSERVE_MEDIA_DIRS", str(tmp_path))
    limits = InputLimits.from_parameters({"allowed_media_dirs": "/srv/media,/data", "max_media_bytes": "5"})
    assert limits.max_media_bytes == 5
    assert tmp_path.resolve() in limits.allowed_media_dirs and len(limits.allowed_media_dirs) == 3


@pytest.mark.parametrize("url", ["/x/\x00y", "/" + "a" * 5000])
def test_unusable_paths_are_named(limits, url):
    with pytest.raises(InvalidInput, match="video_url"):
        parse_request(raw(video_url=[url.encode()]), limits)


def test_symlink_loop_is_named(limits, tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(InvalidInput, match="video_url"):
        parse_request(raw(video_url=[str(tmp_path / "loop").encode()]), limits)


def test_prompt_size_is_capped(limits):
    with pytest.raises(InvalidInput, match="text_input: .* over the limit"):
        parse_request(raw(text_input=[b"a" * (limits.max_prompt_bytes + 1)]), limits)


@pytest.mark.parametrize("prefix", ["DATA:image/png;BASE64,", "Data:image/png;Base64,", "data:image/png;base64,"])
def test_data_url_scheme_and_base64_marker_are_case_insensitive(limits, prefix):
    # RFC 3986 3.1 (schemes), RFC 2397 (the "base64" token)
    url = prefix + base64.b64encode(b"png-bytes").decode()
    assert parse_request(raw(image_url=[url.encode()]), limits).media[0].data == b"png-bytes"


def test_a_data_urls_base64_may_be_wrapped_in_lines_as_the_image_inputs_may(limits):
    """base64 tools write a line break every 76 characters (Python's encodebytes, base64 without -w0); vLLM's
    loader skips them too. Other characters outside the alphabet stay refused."""
    data = bytes(range(256)) * 2
    url = "data:image/png;base64," + base64.encodebytes(data).decode()
    assert "\n" in url and parse_request(raw(image_url=[url.encode()]), limits).media[0].data == data
    for bad in ("data:image/png;base64,iVBO*Rw0K", "data:image/png;base64,iVBOR\u00e9w0K"):
        with pytest.raises(InvalidInput, match="image_url: invalid base64 in data: URL"):
            parse_request(raw(image_url=[bad.encode()]), limits)


def test_uppercase_file_scheme_is_a_file_url(limits, tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"x")
    parsed = parse_request(raw(video_url=[f"FILE://{tmp_path}/a.mp4".encode()]), limits)
    assert parsed.media[0].path == str(tmp_path / "a.mp4")


def test_limits_from_parameters_name_a_bad_size():
    with pytest.raises(ValueError, match="parameter max_media_bytes must be a positive integer, got '0'"):
        InputLimits.from_parameters({"max_media_bytes": "0"})


def _media_error(limits, **kwargs) -> str:
    parsed = parse_request(raw(**kwargs), limits)
    with pytest.raises(InvalidInput) as e:
        plan_media(parsed.media[0], parsed.params, QWEN)
    return str(e.value)


def test_media_errors_name_the_input_the_item_came_from(tmp_path):
    limits = InputLimits(allowed_media_dirs=(tmp_path.resolve(),))
    video = make_video(tmp_path / "v.mp4", 96, 64, 4, 24, codec="libx264")
    not_an_image = NOT_AN_IMAGE.removeprefix("image: ")
    assert _media_error(limits, image_url=[str(tmp_path / "v.mp4").encode()]) == f"image_url: {not_an_image}"
    data_url = "data:image/png;base64," + base64.b64encode(video).decode()
    assert _media_error(limits, image_url=[data_url.encode()]) == f"image_url: {not_an_image}"
    assert _media_error(limits, image=[video]) == f"image: {not_an_image}"
    (tmp_path / "a.png").write_bytes(make_image(32, 32, "RGB", "PNG"))
    assert _media_error(limits, video_url=[str(tmp_path / "a.png").encode()]).startswith("video_url: this is an image")


def test_video_max_pixels_below_the_frame_minimum_is_a_sampling_parameters_error(tmp_path):
    make_video(tmp_path / "v.mp4", 96, 64, 4, 24, codec="libx264")
    sampling = f'{{"max_pixels": {VIDEO_MIN_PIXELS - 1}}}'.encode()
    limits = InputLimits(allowed_media_dirs=(tmp_path.resolve(),))
    assert _media_error(limits, video_url=[str(tmp_path / "v.mp4").encode()], sampling_parameters=[sampling]) == (
        f"sampling_parameters: max_pixels must be at least {VIDEO_MIN_PIXELS} for a video (Qwen2.5-VL's per-frame "
        f"minimum, 128*28*28), got {VIDEO_MIN_PIXELS - 1}")
    # images accept it (their minimum is 4*28*28)
    image = parse_request(raw(image=[make_image(64, 64, "RGB", "PNG")], sampling_parameters=[sampling]), limits)
    assert plan_media(image.media[0], image.params, QWEN).num_tokens > 0


def test_an_image_over_max_image_pixels_is_refused_from_its_header_at_once(tmp_path):
    """A 10000x10000 PNG (an 'image bomb': seconds and GBs to decode) is refused by its header, naming the limit,
    without decoding it (issue 18)."""
    import time
    import tracemalloc

    from PIL import Image

    path = tmp_path / "bomb.png"
    Image.new("L", (10000, 10000)).save(path)
    item = MediaInput("image", path=str(path), input="image_url")
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(InvalidInput, match=r"image_url: 10000x10000 is 100000000 pixels, over the limit of "
                                           r"50000000 \(parameter max_image_pixels\)"):
        plan_media(item, RequestParams(), QWEN, InputLimits().max_image_pixels)
    elapsed, peak = time.perf_counter() - started, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 1 and peak < 20 << 20, (elapsed, peak)
    assert plan_media(item, RequestParams(), QWEN, 100_000_000).num_tokens > 0  # within a raised limit it is planned


def test_an_image_too_large_for_pillow_to_open_is_refused_with_the_servers_limit(tmp_path):
    """A 69-byte PNG whose header claims 100000x100000 pixels: Pillow refuses to open it (its decompression-bomb
    limit, 178,956,970 pixels by default), so its size is never read; the refusal names max_image_pixels all the
    same, and with no cap of the server's, Pillow's limit."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 0, 0, 0, 0))
    item = MediaInput("image", data=header + chunk(b"IEND", b""), input="image")
    with pytest.raises(InvalidInput, match=r"^image: more than 178956970 pixels by its header, over the limit of "
                                           r"50000000 \(parameter max_image_pixels\): downscale it first$"):
        plan_media(item, RequestParams(), QWEN, InputLimits().max_image_pixels)
    with pytest.raises(InvalidInput, match=r"^image: more than 178956970 pixels by its header, over Pillow's"):
        plan_media(item, RequestParams(), QWEN, None)


def test_more_media_items_than_max_media_items_are_refused_before_any_is_read():
    image = make_image(32, 32)
    limits = InputLimits(max_media_items=3)
    assert len(parse_request(RawRequest(text_input=[b"x"], image=[image] * 3), limits).media) == 3
    with pytest.raises(InvalidInput, match=r"image and video inputs: 4 media items, over the limit of 3 per request "
                                           r"\(parameter max_media_items\)"):
        parse_request(RawRequest(text_input=[b"x"], image=[image] * 2, image_url=[b"/nowhere.png"] * 2), limits)
