"""client.http_stream without Triton: SSE parsing of canned bytes, event fields, request body.

The last tests serve canned SSE bytes from a local socket so the urllib streaming and HTTP-error
paths run for real; Triton's own generate_stream is covered by the end-to-end tests.
"""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from client.api import ServerError
from client.http_stream import _error_from_body, generate_stream_http, iter_sse_data, piece_from_event, request_body


def test_sse_events_split_on_blank_lines():
    raw = (b'data: {"text_output": "Hel"}\n\n'
           b'data: {"text_output": "lo"}\r\n\r\n'
           b': keep-alive comment\n\n'
           b'event: message\ndata: {"a":\ndata: 1}\n\n'
           b'data:{"last": true}')  # no space after the colon, no trailing blank line
    events = list(iter_sse_data(raw.splitlines(keepends=True)))
    assert events == ['{"text_output": "Hel"}', '{"text_output": "lo"}', '{"a":\n1}', '{"last": true}']
    assert json.loads(events[2]) == {"a": 1}


def test_event_with_scalars_as_triton_writes_one_element_outputs():
    media = [{"kind": "image", "width": 3, "height": 2}]
    p = piece_from_event({"model_name": "orchestrator", "model_version": "1", "text_output": "ü",
                          "num_input_tokens": 9, "num_output_tokens": 1, "output_ids": 42, "media": json.dumps(media)})
    assert p.text == "ü".encode() and p.token_ids == (42,) and p.num_input_tokens == 9
    assert p.num_output_tokens == 1 and p.finish_reason is None and p.media == media and p.visual_cap is None


def test_an_event_with_log_probabilities_as_a_token_channel_entry_carries_them():
    """A channel entry (and an SSE event) holds ``logprobs`` as JSON text and ``cumulative_logprob`` as a number."""
    entries = [{"42": {"logprob": -0.25, "rank": 1, "decoded_token": "x"}}]
    p = piece_from_event({"text_output": "x", "output_ids": [42], "logprobs": json.dumps(entries),
                          "cumulative_logprob": -0.25})
    assert p.logprobs == entries and p.cumulative_logprob == -0.25


def test_event_with_lists_and_finish_reason():
    p = piece_from_event({"text_output": ["a", "b"], "output_ids": [1, 2, 3], "finish_reason": "length"})
    assert p.text == b"ab" and p.token_ids == (1, 2, 3) and p.finish_reason == "length"


def test_error_event_raises_with_the_message():
    with pytest.raises(ServerError, match="max_tokens must be >= 1"):
        piece_from_event({"error": "max_tokens must be >= 1"})


@pytest.mark.parametrize("body", [b'{"error": "video: not a video"}', b'data: {"error": "video: not a video"}\n\n'])
def test_error_body_json_or_sse(body):
    assert _error_from_body(body, 400) == "video: not a video"


def test_error_body_that_is_not_json_keeps_status_and_text():
    assert _error_from_body(b"<html>bad gateway</html>", 502) == "HTTP 502: <html>bad gateway</html>"


def test_request_body_fields():
    body = request_body("Q?", video_url="/data/v.mp4", image_url=["/data/1.png"], sampling={"max_tokens": 3},
                        return_output_ids=True)
    assert body == {"text_input": "Q?", "sampling_parameters": '{"max_tokens": 3}', "stream": True,
                    "video_url": ["/data/v.mp4"], "image_url": ["/data/1.png"], "return_output_ids": True}
    assert "return_output_ids" not in request_body("Q?") and "video_url" not in request_body("Q?")


class _Canned(BaseHTTPRequestHandler):
    status = 200
    chunks: list = []
    seen: list = []

    def do_POST(self):
        length = int(self.headers["Content-Length"])
        type(self).seen.append((self.path, json.loads(self.rfile.read(length))))
        self.send_response(self.status)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.end_headers()
        for chunk in self.chunks:
            self.wfile.write(chunk)
            self.wfile.flush()

    def log_message(self, *args):
        pass


@pytest.fixture
def canned_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Canned)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Canned.seen = []
    yield server
    server.shutdown()
    server.server_close()


def test_generate_stream_http_over_a_socket(canned_server):
    _Canned.status = 200
    _Canned.chunks = [b'data: {"text_output": "Hi", "num_input_tokens": 4, "num_output_tokens": 1, '
                      b'"output_ids": 5}\n\n',
                      b'data: {"text_output": " there", "num_output_tokens": 2, "output_ids": 6, '
                      b'"finish_reason": "stop"}\n\n']
    got = []
    r = generate_stream_http("Q", url=f"127.0.0.1:{canned_server.server_port}", video_url="/v.mp4",
                             sampling={"max_tokens": 2}, return_output_ids=True, on_text=got.append, timeout_s=10)
    assert r.text == "Hi there" and got == ["Hi", " there"] and r.token_ids == [5, 6]
    assert r.num_input_tokens == 4 and r.num_output_tokens == 2 and r.finish_reason == "stop"
    assert r.ttft_ms is not None and len(r.tbt_ms) == 1
    path, body = _Canned.seen[0]
    assert path == "/v2/models/orchestrator/generate_stream" and body["video_url"] == ["/v.mp4"]


def test_generate_stream_http_first_response_error_is_status_400(canned_server):
    _Canned.status = 400
    _Canned.chunks = [b'data: {"error": "video_url: /etc/passwd is outside the allowed folders"}\n\n']
    with pytest.raises(ServerError, match="outside the allowed folders"):
        generate_stream_http("Q", url=f"127.0.0.1:{canned_server.server_port}", timeout_s=10)


def test_generate_stream_http_error_after_text(canned_server):
    _Canned.status = 200
    _Canned.chunks = [b'data: {"text_output": "Hi"}\n\n', b'data: {"error": "decode worker died"}\n\n']
    with pytest.raises(ServerError, match="decode worker died"):
        generate_stream_http("Q", url=f"127.0.0.1:{canned_server.server_port}", timeout_s=10)


def test_a_stream_cut_before_its_final_event_is_an_error(canned_server):
    _Canned.status = 200
    _Canned.chunks = [b'data: {"text_output": "Hi", "num_output_tokens": 1}\n\n']  # then the connection closes
    with pytest.raises(ServerError, match="ended before its final event"):
        generate_stream_http("Q", url=f"127.0.0.1:{canned_server.server_port}", timeout_s=10)
