"""bench/timeline_chart.py: a request's timeline events -> Gantt bars, and the chart drawn from them."""
from PIL import Image

from bench.timeline_chart import gantt_chart, spans

EVENTS = [
    {"ms": 1.0, "event": "parsed"}, {"ms": 5.0, "event": "probed", "items": 1},
    {"ms": 8.0, "event": "prompt_built", "tokens": 300, "visual_tokens": 256},
    {"ms": 9.0, "event": "engine_added", "replica": 0},
    {"ms": 12.0, "event": "step", "launched_ms": 10.0, "encode_groups": 0, "encode_patches": 0, "prefill_tokens": 20,
     "worker_ms": 1.5},
    {"ms": 30.0, "event": "group_ready", "item": 0, "index": 0, "pages": 4},
    {"ms": 60.0, "event": "step", "launched_ms": 31.0, "encode_groups": 1, "encode_patches": 1024,
     "prefill_tokens": 280, "worker_ms": 28.0},
    {"ms": 61.0, "event": "first_token"}, {"ms": 70.0, "event": "last_token"},
]


def test_the_bars_say_where_the_time_to_first_token_went():
    assert spans(EVENTS) == [
        ("admission", "admission", 0.0, 9.0), ("first token", "first token", 0.0, 61.0),
        ("media", "media", 9.0, 30.0), ("step 0", "prefill", 10.0, 12.0), ("media", "media", 30.0, 30.0),
        ("step 1", "encode", 31.0, 60.0)]
    assert spans([{"ms": 0.5, "event": "parsed"}]) == []  # refused before the engine: nothing to draw


def test_the_chart_has_a_row_per_label_and_merges_many_steps(tmp_path):
    gantt_chart("one image", spans(EVENTS), tmp_path / "few.png")
    many = EVENTS[:4] + [{"ms": 10.0 + k + 1, "event": "step", "launched_ms": 10.0 + k, "encode_groups": k % 2,
                          "encode_patches": 0, "prefill_tokens": 1, "worker_ms": 1.0} for k in range(200)]
    gantt_chart("a long video", spans(many), tmp_path / "many.png")
    few, merged = (Image.open(tmp_path / name) for name in ("few.png", "many.png"))
    assert few.height == 60 + 14 * 5 + 30  # admission, first token, media, step 0, step 1
    assert merged.height == 60 + 14 * 2 + 30  # admission, steps (no media, no first token in that timeline)
