"""python -m client: argument handling, the summary and media lines (no server)."""
import pytest

from client.__main__ import (build_parser, data_url, main, media_lines, sampling_from_args, sent_as_url_note,
                             summary_line)
from client.api import GenerationResult


def test_sampling_only_has_the_given_options():
    args = build_parser().parse_args(["--max-tokens", "64", "--seed", "7", "--fps", "2", "--max-pixels", "200704",
                                      "--min-pixels", "50176", "--ignore-eos", "What happens?"])
    assert sampling_from_args(args) == {"max_tokens": 64, "seed": 7, "fps": 2.0, "max_pixels": 200704,
                                        "min_pixels": 50176, "ignore_eos": True}
    assert args.question == "What happens?"
    internvl = build_parser().parse_args(["--num-frames", "16", "--max-tiles", "6", "Q"])  # InternVL3's settings
    assert sampling_from_args(internvl) == {"num_frames": 16, "max_tiles": 6}
    tiles = build_parser().parse_args(["--min-tiles", "2", "--one-tile", "Q"])
    assert sampling_from_args(tiles) == {"min_tiles": 2, "dynamic_image_size": False}


def test_images_repeat_and_question_stays_positional(tmp_path):
    args = build_parser().parse_args(["--image", "a.png", "--image", "b.png", "Compare them."])
    assert [p.name for p in args.image] == ["a.png", "b.png"] and args.question == "Compare them."


def test_video_and_video_url_are_exclusive():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--video", "a.mp4", "--video-url", "/b.mp4", "Q"])


def test_a_file_becomes_a_base64_data_url(tmp_path):
    image = tmp_path / "a.png"
    image.write_bytes(b"\x89PNG-bytes")
    assert data_url(image) == "data:application/octet-stream;base64,iVBORy1ieXRlcw=="


def test_an_error_naming_the_url_input_a_file_went_in_says_so_over_http():
    parse = build_parser().parse_args
    over_http = parse(["--http", "127.0.0.1:8000", "--video", "a.mp4", "Q"])
    assert sent_as_url_note(over_http, "video_url: truncated file") == (
        "note: --video files are sent to --http as data: URLs in video_url")
    assert sent_as_url_note(over_http, "sampling_parameters: top_p must be in (0, 1]") is None
    images = parse(["--http", "127.0.0.1:8000", "--image", "a.png", "Q"])
    assert sent_as_url_note(images, "image_url (item 1): not an image") == (
        "note: --image files are sent to --http as data: URLs in image_url")
    assert sent_as_url_note(parse(["--video", "a.mp4", "Q"]), "video_url: x") is None  # gRPC sends the bytes


def test_unreachable_server_exits_1_with_message(capsys):
    assert main(["--http", "127.0.0.1:1", "Q", "--timeout", "5"]) == 1
    assert "error:" in capsys.readouterr().err


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("client.__main__.generate_stream_http", interrupted)
    assert main(["--http", "127.0.0.1:1", "Q"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted: the request was cancelled"


def test_summary_line():
    r = GenerationResult(text="x", num_output_tokens=3, finish_reason="stop", ttft_ms=123.44, tbt_ms=[5.0, 6.2])
    assert summary_line(r) == "TTFT 123.4 ms, mean TBT 5.6 ms, 3 output tokens, finish_reason=stop"
    assert summary_line(GenerationResult()) == "TTFT n/a, mean TBT n/a, ? output tokens, finish_reason=None"


def test_media_lines_say_what_the_server_did_with_each_item():
    video = {"kind": "video", "grid_thw": [1, 20, 28], "visual_tokens": 140, "frames_in_file": 1, "duration_s": 0.1,
             "frames": 1, "sampled_frames": 2, "fps": 20.0}
    r = GenerationResult(media=[{"kind": "image", "grid_thw": [1, 26, 46], "visual_tokens": 299, "width": 640,
                                 "height": 360}, video],
                         visual_cap={"max_visual_tokens": 500, "visual_tokens": 439, "fps": None})
    assert media_lines(r) == [
        "image 1: grid_thw [1, 26, 46], visual_tokens 299, width 640, height 360",
        "video 2: grid_thw [1, 20, 28], visual_tokens 140, frames_in_file 1, duration_s 0.1, frames 1, "
        "sampled_frames 2, fps 20.0",
        "visual_cap: max_visual_tokens 500, visual_tokens 439"]
    assert media_lines(GenerationResult()) == []
