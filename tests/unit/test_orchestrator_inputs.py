"""Request validation at the Triton boundary (orchestrator/inputs.py): every problem is named."""
from __future__ import annotations

import base64

import pytest

from orchestrator.inputs import InputLimits, RawRequest, parse_request
from orchestrator.sampling_params import InvalidInput


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
    assert parsed.stream and parsed.params.max_tokens == 16


def test_file_url_under_allowed_folder(limits, tmp_path):
    (tmp_path / "b c.mp4").write_bytes(b"x")
    parsed = parse_request(raw(video_url=[f"file://{tmp_path}/b%20c.mp4".encode()]), limits)
    assert parsed.media[0].path.endswith("b c.mp4")


@pytest.mark.parametrize("kwargs,words", [
    (dict(text_input=[b""]), "text_input: the prompt is empty"),
    (dict(text_input=[b"\xff\xfe"]), "not valid UTF-8"),
    (dict(text_input=[b"a", b"b"]), "expected one string"),
    (dict(video=[b""]), "empty video"),
    (dict(image=[b"x" * 1001]), "over the limit"),
    (dict(video_url=[b"/etc/passwd"]), "outside the allowed media folders"),
    (dict(video_url=[b"http://example.com/v.mp4"]), "http(s) URLs are not fetched"),
    (dict(image_url=[b"data:image/png,abc"]), "only base64 data: URLs"),
    (dict(image_url=[b"data:image/png;base64,@@@"]), "invalid base64"),
    (dict(video_url=[b"ftp://host/v.mp4"]), "unsupported URL scheme"),
    (dict(sampling_parameters=[b'{"max_tokens": 0}']), "max_tokens"),
])
def test_bad_inputs_are_named(limits, kwargs, words):
    with pytest.raises(InvalidInput, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_request(raw(**kwargs), limits)


def test_dotdot_cannot_escape_the_allowed_folder(limits, tmp_path):
    with pytest.raises(InvalidInput, match="outside"):
        parse_request(raw(video_url=[f"{tmp_path}/../etc/passwd".encode()]), limits)


def test_missing_file_is_named(limits, tmp_path):
    with pytest.raises(InvalidInput, match="not a regular file"):
        parse_request(raw(video_url=[str(tmp_path / "nope.mp4").encode()]), limits)


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
