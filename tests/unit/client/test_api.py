"""client.api without a server: input tensors, response parsing, TTFT/TBT bookkeeping."""
import json

import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import serialize_byte_tensor

from client.api import CANCELLED, GenerationResult, _Collector, grpc_inputs, request_tensors
from client.pieces import ResponsePiece, piece_from_grpc

MEDIA = [{"kind": "video", "grid_thw": [1, 20, 28], "frames_in_file": 1, "frames": 1, "sampled_frames": 2}]


def by_name(tensors):
    return {name: (array, dtype) for name, array, dtype in tensors}


def test_text_only_request_has_the_three_required_inputs():
    t = by_name(request_tensors("Hi", sampling={"max_tokens": 4, "seed": 1}))
    assert set(t) == {"text_input", "sampling_parameters", "stream"}
    text, dtype = t["text_input"]
    assert dtype == "BYTES" and text.shape == (1,) and text.dtype == object and text[0] == b"Hi"
    params, dtype = t["sampling_parameters"]
    assert dtype == "BYTES" and json.loads(params[0]) == {"max_tokens": 4, "seed": 1}
    stream, dtype = t["stream"]
    assert dtype == "BOOL" and stream.dtype == bool and stream.tolist() == [True]


def test_sampling_defaults_to_empty_json_and_stream_false_is_sent():
    t = by_name(request_tensors("Hi", stream=False))
    assert json.loads(t["sampling_parameters"][0][0]) == {}
    assert t["stream"][0].tolist() == [False]
    assert t["exclude_input_in_output"][0].tolist() == [True]  # the reply alone, as when streaming
    assert "exclude_input_in_output" not in by_name(request_tensors("Hi", stream=False, exclude_input_in_output=False))
    assert "exclude_input_in_output" not in by_name(request_tensors("Hi"))


def test_media_tensors_names_shapes_and_bytes():
    t = by_name(request_tensors("Describe.", video=b"\x00mp4", image=[b"png1", b"png2"],
                                video_url="/data/a.mp4", image_url=["/data/1.png", "file:///data/2.png"]))
    assert t["video"][0].shape == (1,) and t["video"][0][0] == b"\x00mp4" and t["video"][1] == "BYTES"
    assert t["image"][0].tolist() == [b"png1", b"png2"]
    assert t["video_url"][0].tolist() == [b"/data/a.mp4"]
    assert t["image_url"][0].tolist() == [b"/data/1.png", b"file:///data/2.png"]
    assert all(dtype == "BYTES" for name, (a, dtype) in t.items() if name != "stream")


def test_single_image_bytes_becomes_one_element():
    assert by_name(request_tensors("x", image=b"jpeg"))["image"][0].tolist() == [b"jpeg"]


def test_return_output_ids_only_sent_when_asked():
    assert "return_output_ids" not in by_name(request_tensors("x"))
    a, dtype = by_name(request_tensors("x", return_output_ids=True))["return_output_ids"]
    assert dtype == "BOOL" and a.tolist() == [True]


def test_return_logprobs_asks_for_both_log_probability_outputs():
    assert "return_logprobs" not in by_name(request_tensors("x"))
    tensors = by_name(request_tensors("x", sampling={"logprobs": 2}, return_logprobs=True))
    assert [tensors[name][0].tolist() for name in ("return_logprobs", "return_cumulative_logprob")] == [[True]] * 2


def test_the_collector_gathers_log_probabilities_and_keeps_the_last_sum():
    first, second = {"1": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}, {"2": {"logprob": -1.0}}
    c = _Collector(t0=0.0)
    c.add(0.1, ResponsePiece(text=b"a", token_ids=(1,), logprobs=[first], cumulative_logprob=-0.5))
    c.add(0.2, ResponsePiece(text=b"b", token_ids=(2,), logprobs=[second], cumulative_logprob=-1.5))
    r = c.finish()
    assert r.logprobs == [first, second] and r.cumulative_logprob == -1.5
    assert _Collector(t0=0.0).finish().logprobs == []


@pytest.mark.parametrize("kw", [dict(text=b"bytes"), dict(text="x", video="/path.mp4"),
                                dict(text="x", image="/path.png"), dict(text="x", image=[1, 2])])
def test_wrong_types_raise_type_error(kw):
    with pytest.raises(TypeError):
        request_tensors(**kw)


def test_grpc_inputs_carry_names_datatypes_and_shapes():
    inputs = grpc_inputs(request_tensors("Hi", image=[b"a", b"b"]))
    seen = {i.name(): (i.datatype(), i.shape()) for i in inputs}
    assert seen == {"text_input": ("BYTES", [1]), "sampling_parameters": ("BYTES", [1]),
                    "stream": ("BOOL", [1]), "image": ("BYTES", [2])}


def infer_result(outputs: dict, final: bool = False) -> InferResult:
    """A real tritonclient InferResult built from the protobuf the server sends."""
    resp = service_pb2.ModelInferResponse(model_name="orchestrator", model_version="1")
    for name, (array, dtype) in outputs.items():
        out = resp.outputs.add(name=name, datatype=dtype, shape=list(array.shape))
        assert out.name == name
        raw = serialize_byte_tensor(array).item() if dtype == "BYTES" else array.tobytes()
        resp.raw_output_contents.append(raw)
    if final:
        resp.parameters["triton_final_response"].bool_param = True
    return InferResult(resp)


LOGPROBS = [{"7": {"logprob": -0.5, "rank": 1, "decoded_token": "w"}},
            {"8": {"logprob": -1.0, "rank": 2, "decoded_token": "ö"}}]


def test_piece_from_grpc_reads_every_output():
    r = infer_result({
        "text_output": (np.array(["wörld".encode()], dtype=object), "BYTES"),
        "num_input_tokens": (np.array([12], np.int32), "INT32"),
        "num_output_tokens": (np.array([3], np.int32), "INT32"),
        "finish_reason": (np.array([b"stop"], dtype=object), "BYTES"),
        "output_ids": (np.array([7, 8], np.int64), "INT64"),
        "media": (np.array([json.dumps(MEDIA).encode()], dtype=object), "BYTES"),
        "logprobs": (np.array([json.dumps(LOGPROBS).encode()], dtype=object), "BYTES"),
        "cumulative_logprob": (np.array([-1.5], np.float32), "FP32"),
    }, final=True)
    p = piece_from_grpc(r)
    assert p == ResponsePiece(text="wörld".encode(), token_ids=(7, 8), num_input_tokens=12, num_output_tokens=3,
                              finish_reason="stop", final=True, media=MEDIA, logprobs=LOGPROBS,
                              cumulative_logprob=-1.5)


def test_empty_final_response_is_final_without_output():
    p = piece_from_grpc(infer_result({}, final=True))
    assert p.final and not p.has_output and p.finish_reason is None and p.text == b""


def test_collector_times_and_concatenates():
    got = []
    c = _Collector(t0=10.0, on_text=got.append)
    c.add(10.100, ResponsePiece(text=b"Hel", token_ids=(1,), num_input_tokens=5, num_output_tokens=1, media=MEDIA))
    c.add(10.110, ResponsePiece(text=b"lo", token_ids=(2,), num_output_tokens=2))
    c.add(10.125, ResponsePiece(text=b"!", token_ids=(3,), num_output_tokens=3, finish_reason="stop"))
    c.add(10.200, ResponsePiece(final=True))  # the empty final response is neither a token nor a gap
    r = c.finish()
    assert r.text == "Hello!" and got == ["Hel", "lo", "!"]
    assert r.token_ids == [1, 2, 3] and r.num_input_tokens == 5 and r.num_output_tokens == 3
    assert r.finish_reason == "stop" and r.num_responses == 3 and r.media == MEDIA  # from the first response
    assert r.ttft_ms == pytest.approx(100.0)
    assert r.tbt_ms == pytest.approx([10.0, 15.0])
    assert r.mean_tbt_ms == pytest.approx(12.5)


def test_a_response_whose_tokens_have_no_text_yet_is_the_first_token_all_the_same():
    """Without output ids a response may bring tokens whose text is held back (dummy weights' bytes, special
    tokens): it is an output (TTFT) unless it is the last, which may carry none (the empty final response)."""
    c = _Collector(t0=0.0)
    c.add(0.100, ResponsePiece(text=b""))
    c.add(0.110, ResponsePiece(text=b"ab"))
    c.add(0.150, ResponsePiece(text=b"", num_output_tokens=4, finish_reason="length", final=True))
    r = c.finish()
    assert r.ttft_ms == pytest.approx(100.0) and r.num_responses == 2 and r.tbt_ms == pytest.approx([10.0])


def test_a_response_of_several_tokens_counts_a_gap_per_token():
    """The server sends the tokens queued up behind it as one response: TBT stays per token (the wait shared
    among the response's tokens; the first response's extra tokens count no gap, so one non-streamed response
    has no TBT)."""
    c = _Collector(t0=0.0)
    c.add(0.100, ResponsePiece(text=b"ab", token_ids=(1, 2)))
    c.add(0.130, ResponsePiece(text=b"cde", token_ids=(3, 4, 5)))
    c.add(0.140, ResponsePiece(text=b"f", token_ids=(6,), finish_reason="length"))
    r = c.finish()
    assert r.num_responses == 3 and r.ttft_ms == pytest.approx(100.0)
    assert r.tbt_ms == pytest.approx([10.0, 10.0, 10.0, 10.0])
    assert r.mean_tbt_ms == pytest.approx((140.0 - 100.0) / 4)
    whole = _Collector(t0=0.0)
    whole.add(0.5, ResponsePiece(text=b"abcdef", token_ids=(1, 2, 3, 4, 5, 6), finish_reason="length"))
    assert whole.finish().mean_tbt_ms is None


def test_collector_joins_a_character_split_across_responses():
    data = "日本".encode()  # 6 bytes; split inside the first character
    got = []
    c = _Collector(0.0, got.append)
    c.add(0.1, ResponsePiece(text=data[:2]))
    c.add(0.2, ResponsePiece(text=data[2:]))
    assert c.finish().text == "日本" and "".join(got) == "日本"


def test_collector_counts_tokens_from_ids_when_server_sends_no_count_and_marks_cancel():
    c = _Collector(0.0)
    c.add(0.05, ResponsePiece(token_ids=(4, 5)))
    r = c.finish(cancelled=True)
    assert r.num_output_tokens == 2 and r.finish_reason == CANCELLED and r.ttft_ms == pytest.approx(50.0)


def test_mean_tbt_is_none_without_gaps():
    assert GenerationResult().mean_tbt_ms is None
    assert GenerationResult(tbt_ms=[2.0, 4.0]).mean_tbt_ms == 3.0
