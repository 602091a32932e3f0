"""Client responses described on the event loop and built on a send lane (orchestrator/replies.py): merged replies
are what one response for their tokens would have been, and the vLLM backend's ``return_*`` outputs keep their
meaning after a merge; errors and the abort's empty final response are never merged."""
import dataclasses
import json
import threading

import numpy as np
import pytest

from orchestrator.inputs import ExtraOutputs, ParsedRequest
from orchestrator.replies import Built, Reply, first_outputs
from orchestrator.sampling_params import RequestParams
from orchestrator.send_lanes import SendLanes, merged
from orchestrator.timeline import Timeline
from tests.unit.orchestrator import fake_responses
from tests.unit.orchestrator.fake_responses import FINAL


@pytest.fixture(autouse=True)
def pb(monkeypatch):
    fake_responses.install(monkeypatch)


def parsed(**extra) -> ParsedRequest:
    return ParsedRequest("Hi", (), RequestParams(), True, False, extra.pop("output_ids", True), (),
                         ExtraOutputs(**extra))


MEDIA = [{"kind": "video", "frames_in_file": 1, "frames": 1, "sampled_frames": 2}]
HEAD = first_outputs(visual_cap={"fps": 1}, media=MEDIA)


def replies(request: ParsedRequest, texts: list[str], timeline=None) -> list[Reply]:
    """One streamed reply per text (token id k for the k-th), the last one final; the first carries ``HEAD``."""
    out = []
    for k, text in enumerate(texts):
        last = k == len(texts) - 1
        out.append(Reply(request, text, [k], "length" if last else None, 7, k + 1, FINAL if last else 0,
                         HEAD if k == 0 else (), timeline or Timeline(0.0), num_cached=3))
    return out


def test_queued_replies_of_one_request_merge_in_order_the_final_last():
    a, b = object(), object()
    ra, rb = replies(parsed(), ["A0", "A1", "A2"]), replies(parsed(), ["B0", "B1"])
    out = merged([(a, ra[0]), (b, rb[0]), (a, ra[1]), (b, rb[1]), (a, ra[2])])
    assert [s for s, _ in out] == [a, b]  # no merge across requests
    (_, one_a), (_, one_b) = out
    assert (one_a.text, one_a.ids, one_a.reason, one_a.flags) == ("A0A1A2", [0, 1, 2], "length", FINAL)
    assert (one_b.text, one_b.ids, one_b.num_output) == ("B0B1", [0, 1], 2)


def test_a_final_reply_takes_nothing_after_it():
    last, later = replies(parsed(), ["x"])[0], replies(parsed(), ["y", "z"])[0]
    assert last.merge(later) is None


def test_return_flags_keep_their_meaning_after_a_merge():
    request = parsed(finish_reason=True, num_input_tokens=True, num_output_tokens=True, timeline=True)
    first, second, third, last = replies(request, ["a", "b", "c", "d"], timeline=Timeline(0.0))
    head = first.merge(second).build().outputs()  # the first response, merged
    tail = third.merge(last).build().outputs()
    assert head == {"text_output": ["ab"], "visual_cap": ['{"fps": 1}'], "media": [json.dumps(MEDIA)],
                    "output_ids": [0, 1], "finish_reason": ["None"], "num_input_tokens": [7], "num_cached_tokens": [3],
                    "num_output_tokens": [2]}  # the prompt's counts together, from the first response on
    assert tail["text_output"] == ["cd"] and tail["output_ids"] == [2, 3]
    assert "visual_cap" not in tail and "media" not in tail
    assert tail["finish_reason"] == ["length"] and tail["num_output_tokens"] == [2]  # that response's tokens
    assert tail["num_cached_tokens"] == [3] and tail["num_input_tokens"] == [7]
    assert [e["event"] for e in json.loads(tail["timeline"][0])["events"]] == ["final_response"]


def test_log_probabilities_join_in_a_merge_and_the_cumulative_sum_is_the_later_ones():
    """``logprobs`` (JSON: an entry per token) and ``cumulative_logprob`` (FP32: the output's sum so far) on every
    response of a request that asked; a merged response's entries are both replies', its sum the later's."""
    request = parsed(logprobs=True, cumulative_logprob=True)
    entries = [{"5": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}},
               {"6": {"logprob": -1.0, "rank": 2, "decoded_token": "b"}}]
    first = Reply(request, "a", [5], None, 7, 1, logprobs=entries[:1], cumulative_logprob=-0.5)
    last = Reply(request, "b", [6], "length", 7, 2, FINAL, logprobs=entries[1:], cumulative_logprob=-1.5)
    outputs = first.merge(last).build().outputs()
    assert json.loads(outputs["logprobs"][0]) == entries and outputs["cumulative_logprob"] == [-1.5]
    assert "logprobs" not in replies(parsed(), ["x"])[0].build().outputs()


def test_without_flags_the_merged_last_response_carries_the_whole_outputs_count():
    request = parsed(output_ids=False)
    first, second, last = replies(request, ["a", "b", "c"])
    assert first.merge(second).build().outputs() == {"text_output": ["ab"], "visual_cap": ['{"fps": 1}'],
                                                     "media": [json.dumps(MEDIA)]}
    assert replies(request, ["a", "b", "c"])[1].merge(last).build().outputs() == {
        "text_output": ["bc"], "finish_reason": ["length"], "num_input_tokens": [7], "num_output_tokens": [3],
        "num_cached_tokens": [3], "stop_reason": ["null"]}


def test_the_last_response_carries_the_stop_reason_as_json_and_a_merge_keeps_the_later_ones():
    request = parsed(output_ids=False)
    for stop_reason, sent in [("four", '"four"'), (151643, "151643"), ("\n", '"\\n"')]:
        first, _, last = replies(request, ["a", "b", "c"])
        merged = first.merge(dataclasses.replace(last, stop_reason=stop_reason)).build().outputs()
        assert merged["stop_reason"] == [sent] and json.loads(sent) == stop_reason
    assert "stop_reason" not in replies(request, ["a", "b"])[0].build().outputs()  # on the last only


def test_the_first_response_carries_media_and_visual_cap_only_where_the_request_has_them():
    """A request without media has neither output; one without a cap has media alone, on its first response only."""
    assert first_outputs(visual_cap=None, media=None) == ()
    first, later = (Reply(parsed(output_ids=False), "x", [k], None, 7, k + 1, 0,
                          first_outputs(visual_cap=None, media=MEDIA) if k == 0 else ()) for k in range(2))
    assert first.build().outputs() == {"text_output": ["x"], "media": [json.dumps(MEDIA)]}
    assert json.loads(first.build().outputs()["media"][0]) == MEDIA
    assert first.merge(later).build().outputs()["media"] == [json.dumps(MEDIA)]  # a merged first response keeps it
    assert later.build().outputs() == {"text_output": ["x"]}


def test_the_prompts_ids_go_as_int64_input_ids_on_the_first_response_and_a_merge_keeps_them():
    """``return_input_ids``: the head's ``input_ids`` (a list) is an INT64 tensor (the ``tokenize_only`` response's
    output), on the first response only; on a token channel it is a JSON list (``Reply.fields``)."""
    first, later = (Reply(parsed(output_ids=False, input_ids=True), "x", [k], None, 7, k + 1, 0,
                          (("input_ids", [151644, 8948, 5]),) if k == 0 else ()) for k in range(2))
    assert first.build().outputs() == {"text_output": ["x"], "input_ids": [151644, 8948, 5]}
    assert [t.as_numpy().dtype for t in first.build().output_tensors if t.name() == "input_ids"] == [np.int64]
    assert first.merge(later).build().outputs()["input_ids"] == [151644, 8948, 5]
    assert "input_ids" not in later.build().outputs()
    assert json.loads(json.dumps(first.fields()))["input_ids"] == [151644, 8948, 5]


def test_errors_and_the_abort_are_never_merged():
    sender = object()
    first, second = replies(parsed(), ["a", "b", "c"])[:2]
    error, abort = Built("an error response", FINAL), Built(flags=FINAL)
    assert merged([(sender, first), (sender, error)]) == [(sender, first), (sender, error)]
    assert merged([(sender, first), (sender, second), (sender, abort)]) == [
        (sender, first.merge(second)), (sender, abort)]
    assert error.merge(first) is None and abort.build() is None and error.build() == "an error response"


def test_a_reply_that_cannot_be_built_becomes_an_internal_error():
    bad = Reply(parsed(), "x", ["not a token id"], "length", 1, 1, FINAL)
    response = bad.build()
    assert response.error.code == "INTERNAL" and "internal error" in response.error.message


class BlockedSender:
    """Its first send waits until ``go`` is set; records every response's outputs and flags."""

    def __init__(self):
        self.go, self.waiting, self.sent = threading.Event(), threading.Event(), []

    def send(self, response=None, flags=0):
        if not self.sent:
            self.waiting.set()
            self.go.wait(5)
        self.sent.append((response.outputs(), flags))


def test_a_lane_that_fell_behind_sends_the_queued_tokens_as_one_response():
    lanes, sender = SendLanes(1), BlockedSender()
    lane = lanes.lane()
    request = parsed(num_output_tokens=True)
    first, *rest = replies(request, ["one", " two", " three", " four"])
    lanes.send(lane, sender, first)
    assert sender.waiting.wait(5)
    for reply in rest:
        lanes.send(lane, sender, reply)
    sender.go.set()
    lanes.close()
    assert [(outputs["text_output"], outputs["num_output_tokens"], flags) for outputs, flags in sender.sent] == [
        (["one"], [1], 0), ([" two three four"], [3], FINAL)]


def test_each_sent_token_is_noted_on_the_timeline_once_the_response_is_handed_over():
    lanes, sender, timeline = SendLanes(1), BlockedSender(), Timeline(0.0)
    lane = lanes.lane()
    first, *rest = replies(parsed(timeline=True), ["one", " two", " three"], timeline=timeline)
    lanes.send(lane, sender, first)
    assert sender.waiting.wait(5)
    assert timeline.tokens["sent_us"] == []  # not yet handed over
    for reply in rest:
        lanes.send(lane, sender, reply)
    sender.go.set()
    lanes.close()
    one, two, three = timeline.tokens["sent_us"]  # the last two in one response, noted once each
    assert one <= two == three
    final_json = json.loads(sender.sent[-1][0]["timeline"][0])
    assert final_json["tokens"] == {"sent_us": [one]}  # built before its own send: the earlier ones only
