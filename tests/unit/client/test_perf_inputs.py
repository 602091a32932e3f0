"""perf_analyzer input-data JSON: shapes and the serialized BYTES layout perf_analyzer expects."""
import base64
import json

import numpy as np
from tritonclient.utils import deserialize_bytes_tensor

from client.perf_analyzer.make_inputs import bytes_elements_b64, main, make_entry, make_input_data


def decode_bytes_input(value: dict) -> list:
    raw = base64.b64decode(value["content"]["b64"])
    elements = deserialize_bytes_tensor(raw)
    assert list(value["shape"]) == [len(elements)]
    return [bytes(e) for e in elements]


def test_bytes_layout_is_length_prefixed_little_endian():
    raw = base64.b64decode(bytes_elements_b64([b"ab", b""]))
    assert raw == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"


def test_video_entry_round_trips_through_tritonclients_deserializer():
    video = bytes(range(256)) * 10 + b"\x00\x00"  # trailing zeros must survive
    entry = make_entry("Describe.", video=video, images=[b"img1", b"img2"], sampling={"max_tokens": 16})
    assert entry["text_input"] == ["Describe."]
    assert json.loads(entry["sampling_parameters"][0]) == {"max_tokens": 16}
    assert entry["stream"] == [True]
    assert decode_bytes_input(entry["video"]) == [video]
    assert decode_bytes_input(entry["image"]) == [b"img1", b"img2"]
    assert "video_url" not in entry and "image_url" not in entry


def test_one_entry_per_video_and_url_entries():
    data = make_input_data("Q", videos=[b"v1", b"v2"], video_urls=["/data/v3.mp4"], image_urls=["/data/i.png"],
                           stream=False)
    entries = data["data"]
    assert len(entries) == 3
    assert [decode_bytes_input(e["video"]) for e in entries[:2]] == [[b"v1"], [b"v2"]]
    assert entries[2]["video_url"] == {"content": ["/data/v3.mp4"], "shape": [1]}
    assert all(e["image_url"] == {"content": ["/data/i.png"], "shape": [1]} for e in entries)
    assert all(e["stream"] == [False] for e in entries)


def test_text_only_gives_one_entry():
    assert make_input_data("Hello")["data"] == [make_entry("Hello")]


def test_main_writes_the_file(tmp_path):
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(np.arange(100, dtype=np.uint8).tobytes())
    out = tmp_path / "inputs.json"
    assert main(["--video", str(clip), "--max-tokens", "32", "--ignore-eos", "--fps", "2", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    (entry,) = data["data"]
    assert decode_bytes_input(entry["video"]) == [clip.read_bytes()]
    assert json.loads(entry["sampling_parameters"][0]) == {"max_tokens": 32, "fps": 2.0, "ignore_eos": True}


def test_repeated_options_add_up(tmp_path):
    clips = [tmp_path / f"{name}.mp4" for name in "abc"]
    for n, clip in enumerate(clips):
        clip.write_bytes(bytes([n]) * 10)
    out = tmp_path / "inputs.json"
    assert main(["--video", str(clips[0]), "--video", str(clips[1]), str(clips[2]),
                 "--image-url", "/d/1.png", "--image-url", "/d/2.png", "--video-url", "/d/u.mp4", "-o", str(out)]) == 0
    entries = json.loads(out.read_text())["data"]
    assert [decode_bytes_input(e["video"]) for e in entries[:3]] == [[c.read_bytes()] for c in clips]
    assert entries[3]["video_url"]["content"] == ["/d/u.mp4"] and len(entries) == 4
    assert all(e["image_url"]["content"] == ["/d/1.png", "/d/2.png"] for e in entries)
