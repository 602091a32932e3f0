"""The OpenAI-compatible API (backends/openai) in its own process beside a real tritonserver, driven with the `openai`
SDK: the token ids of each greedy answer equal the KServe path's (client.api.Client) for the same request, a whole
conversation equals transformers' generate() on the tokenizer's own chat template, and errors come in OpenAI's
shape with their HTTP status."""
from __future__ import annotations

import base64
import json
import socket
import urllib.error
import urllib.request

import openai
import pytest
import torch

from backends.openai.config import ApiConfig
from backends.openai.process import ApiProcess
from backends.runtime.loader import ModelSpec, load_model
from client.api import Client
from flashcodec.families import MediaOptions as FamilyOptions
from flashcodec.probe import ImageInfo
from orchestrator.inputs import MediaInput
from orchestrator.media import plan_media
from orchestrator.prompt import QWEN
from orchestrator.sampling_params import RequestParams
from tests.e2e.conftest import assert_closing_cancels, metrics_text, settled
from tests.media import make_image, make_video
from tests.reference import assert_same_or_tie, reference_generate
from tests.unit.backends.openai.test_replica_health import MetricsEndpoint, metrics_endpoint, replica_gauges

pytestmark = pytest.mark.e2e
N = 8
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
EXTRA = {"ignore_eos": True, "return_token_ids": True}  # vLLM's extra fields, in the SDK's extra_body
MODEL = "tiny"  # the preset's name: the default served model name


def _unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _api(grpc_port: int, log_path, **settings) -> ApiProcess:
    return ApiProcess(ApiConfig(grpc_url=f"127.0.0.1:{grpc_port}", port=_unused_port(), **settings), log_path)


def _metrics_url(server) -> str:
    return f"http://127.0.0.1:{server.ports.metrics}/metrics"


@pytest.fixture(scope="module")
def api(server, tmp_path_factory):
    """The API as the launcher starts it: its /health also reads the replicas' gauge on Triton's metrics port."""
    with _api(server.ports.grpc, tmp_path_factory.mktemp("openai") / "api.log", metrics_url=_metrics_url(server)) \
            as process:
        yield process


@pytest.fixture(scope="module")
def sdk(api):
    with openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def kserve(grpc_url):
    with Client(grpc_url) as client:
        yield client


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _streamed(chunks) -> tuple[str, list[int], str | None, object]:
    """(text, token ids, finish_reason, usage) of a chat stream; each chunk is checked for OpenAI's shape."""
    text, ids, reason, usage = "", [], None, None
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            assert chunk.choices == [] and usage is None
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        assert reason is None, "a chunk after the one with finish_reason"
        text += choice.delta.content or ""
        ids += choice.token_ids
        reason = choice.finish_reason
    return text, ids, reason, usage


def test_models_and_health(sdk, api):
    (model,) = sdk.models.list().data
    assert model.id == MODEL and model.max_model_len == 32768
    assert (model.root, model.parent, len(model.permission)) == (MODEL, None, 1)  # vLLM's: the preset, as loaded
    assert sdk.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk.models.retrieve("gpt-4")
    assert unknown.value.body["code"] == "model_not_found"
    assert urllib.request.urlopen(f"{api.url}/health", timeout=10).status == 200
    assert urllib.request.urlopen(f"{api.url}/ping", timeout=10).status == 200  # vLLM's (SageMaker's) name
    metrics = urllib.request.urlopen(f"{api.url}/metrics", timeout=10)  # where vLLM's are: Triton's metrics port's
    text = metrics.read().decode()
    assert metrics.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert "unifiedserve_kv_pages_total" in text and 'nv_inference_count{model="orchestrator"' in text


def test_served_model_names_are_the_names_clients_send(server, tmp_path):
    """vLLM's --served-model-name: a card per name, a request naming any of them served, the reply carrying the
    first; the default name is then refused."""
    with _api(server.ports.grpc, tmp_path / "api.log", served_model_names=("qwen", "Qwen/Qwen2.5-VL-7B-Instruct")) \
            as process, openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0) as client:
        assert [card.id for card in client.models.list().data] == ["qwen", "Qwen/Qwen2.5-VL-7B-Instruct"]
        reply = client.chat.completions.create(model="Qwen/Qwen2.5-VL-7B-Instruct", max_tokens=2, extra_body=EXTRA,
                                               messages=[{"role": "user", "content": "hi"}])
        assert reply.model == "qwen" and reply.usage.completion_tokens == 2
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])


def test_a_tools_answer_in_the_history_is_served(sdk, api):
    """An agent's history: the assistant's tool call (not written, as Qwen2.5-VL's template leaves it out on vLLM),
    the tool's answer as a tool message; /tokenize counts the prompt the reply ran."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    reply = sdk.chat.completions.create(model=MODEL, max_tokens=2, messages=messages, extra_body=EXTRA)
    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    tokenize = urllib.request.Request(f"{api.url}/tokenize", body, {"Content-Type": "application/json"})
    counted = json.loads(urllib.request.urlopen(tokenize, timeout=60).read())
    assert reply.usage.completion_tokens == 2 and reply.usage.prompt_tokens == counted["count"]


def test_with_api_keys_a_request_needs_one(server, tmp_path):
    """vLLM's --api-key, handed to the API process by its environment: the SDK's api_key is sent as a Bearer token;
    a wrong one is the SDK's AuthenticationError; /health and /metrics need none."""
    with _api(server.ports.grpc, tmp_path / "api.log", api_keys=("sk-test", "sk-other")) as process:
        assert "sk-test" not in " ".join(process.process.args)
        assert urllib.request.urlopen(f"{process.url}/health", timeout=10).status == 200
        with pytest.raises(urllib.error.HTTPError) as no_url:  # open (vLLM's too), here without --metrics-url
            urllib.request.urlopen(f"{process.url}/metrics", timeout=10)
        assert no_url.value.code == 404 and "--metrics-url" in json.loads(no_url.value.read())["error"]["message"]
        for key in ("sk-test", "sk-other"):
            with openai.OpenAI(base_url=f"{process.url}/v1", api_key=key, max_retries=0) as client:
                reply = client.chat.completions.create(model=MODEL, max_tokens=2, extra_body=EXTRA,
                                                       messages=[{"role": "user", "content": "hi"}])
                assert reply.usage.completion_tokens == 2  # ignore_eos: a sampled end token would end it sooner
        with openai.OpenAI(base_url=f"{process.url}/v1", api_key="sk-wrong", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError) as refused:
                client.models.list()
        assert refused.value.body["code"] == "invalid_api_key"


def test_health_is_503_once_every_replica_has_ended_though_the_orchestrator_is_ready(server):
    """The real server (ready, its replica serving) with metrics that say what Triton's would once every replica's
    decode loop had ended (no test can end one on demand): /health and /ping answer 503; one replica left, 200;
    without a metrics URL, readiness alone (200)."""
    from fastapi.testclient import TestClient

    from backends.openai.app import create_app

    assert 'unifiedserve_replica_serving{replica="0"} 1' in metrics_text(server)
    grpc_url = f"127.0.0.1:{server.ports.grpc}"

    def statuses(config: ApiConfig) -> set[int]:
        with TestClient(create_app(config)) as client:
            return {client.get("/health").status_code, client.get("/ping").status_code,
                    client.post("/ping").status_code}
    assert statuses(ApiConfig(grpc_url=grpc_url, token_channel=False, metrics_url=_metrics_url(server))) == {200}
    with metrics_endpoint() as metrics_url:
        for body, expected in ((replica_gauges("0", "1"), {200}), (replica_gauges("0", "0"), {503})):
            MetricsEndpoint.body = body
            assert statuses(ApiConfig(grpc_url=grpc_url, token_channel=False, metrics_url=metrics_url)) == expected
    assert statuses(ApiConfig(grpc_url=grpc_url, token_channel=False)) == {200}


def test_text_chat_equals_the_kserve_path(sdk, kserve):
    question = "Tell me about the sea."
    ours = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                       max_tokens=N, temperature=0, extra_body=EXTRA)
    theirs = kserve.generate(question, sampling=GREEDY, stream=False, return_output_ids=True)
    (choice,) = ours.choices
    assert choice.token_ids == theirs.token_ids and len(theirs.token_ids) == N
    assert choice.message.content == theirs.text and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and ours.object == "chat.completion" and ours.model == MODEL
    assert (ours.usage.prompt_tokens, ours.usage.completion_tokens) == (theirs.num_input_tokens, N)
    assert ours.usage.total_tokens == theirs.num_input_tokens + N
    assert ours.model_extra.get("media") is None and theirs.media is None  # no media, no report


def test_a_replys_id_is_the_x_request_id_header_else_the_bodys_request_id(sdk):
    """As vLLM's ``_base_request_id``: the header wins over the body's ``request_id``; without either, random."""
    messages = [{"role": "user", "content": "hi"}]
    chat = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body={"request_id": "b-1"},
                                       extra_headers={"X-Request-Id": "job-7"})
    assert chat.id == "chatcmpl-job-7"
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                              extra_body={"request_id": "b-1"}))
    assert {chunk.id for chunk in chunks} == {"chatcmpl-b-1"}
    assert sdk.completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                  extra_headers={"X-Request-Id": "job-8"}).id == "cmpl-job-8"
    plain = {sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).id for _ in range(2)}
    assert len(plain) == 2 and all(len(i) == len("chatcmpl-") + 32 for i in plain)


@pytest.mark.parametrize("simple", [False, True], ids=["url-object", "url-string"])
def test_streamed_image_chat_equals_the_kserve_path(sdk, kserve, simple):
    """Also with the URL as a plain string (vLLM's simple image part), taken as ``{"url": ...}``."""
    image = make_image(200, 150, "RGB", "JPEG")
    url = _data_url(image, "image/jpeg")
    content = [{"type": "image_url", "image_url": url if simple else {"url": url}},
               {"type": "text", "text": "What is in the picture?"}]
    stream = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                         max_completion_tokens=N, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body=EXTRA)
    text, ids, reason, usage = _streamed(stream)
    theirs = kserve.generate("What is in the picture?", image=image, sampling=GREEDY, return_output_ids=True)
    assert ids == theirs.token_ids and text == theirs.text and reason == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (theirs.num_input_tokens, N)
    assert usage.prompt_tokens > 100  # the image's visual tokens are in the prompt


def test_min_pixels_sizes_an_image_up_as_qwens_processor_does(sdk):
    """mm_processor_kwargs' min_pixels (Qwen2.5-VL's, as vLLM passes it to the processor): a small image resized up to
    it, its visual tokens the plan's (``smart_resize`` with that floor), and what the media report says."""
    image = make_image(64, 48, "RGB", "PNG")
    content = [{"type": "image_url", "image_url": {"url": _data_url(image, "image/png")}},
               {"type": "text", "text": "What is it?"}]

    def ask(kwargs: dict):
        return sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=1,
                                           extra_body={"mm_processor_kwargs": kwargs} if kwargs else None)

    plain, larger = ask({}), ask({"min_pixels": 200704})
    plan = QWEN.plan_image(ImageInfo(64, 48, "RGB", "PNG"), FamilyOptions(min_pixels=200704))
    assert larger.usage.prompt_tokens - plain.usage.prompt_tokens == plan.num_tokens - QWEN.plan_image(
        ImageInfo(64, 48, "RGB", "PNG")).num_tokens > 200
    (media,) = larger.model_extra["media"]
    assert media["visual_tokens"] == plan.num_tokens, media


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_return_timeline_brings_the_requests_timeline(sdk, stream):
    extra = {**EXTRA, "return_timeline": True}
    reply = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi."}], max_tokens=N,
                                        temperature=0, stream=stream, extra_body=extra)
    last = list(reply)[-1] if stream else reply
    timeline = last.model_extra["timeline"]
    events, ms = [e["event"] for e in timeline["events"]], [e["ms"] for e in timeline["events"]]
    # the API process's moments join the orchestrator's, on its scale (ms since the request arrived there)
    assert events[:3] == ["api_received", "api_sent", "parsed"] and ms == sorted(ms) and ms[0] <= ms[1] <= 0 <= ms[2]
    # the orchestrator's last event is its final response; a short streamed reply can be over before the API
    # process has made its first chunk, so the API's moments may come after it
    assert "first_token" in events and [e for e in events if not e.startswith("api_")][-1] == "final_response"
    assert ({"api_first_response", "api_first_chunk"} <= set(events)) == stream
    # per token: decode's moments from the second token on; the API's chunk of each token when streamed (the
    # timeline comes in a chunk of its own after the last tokens', with the finish reason)
    tokens = timeline["tokens"]
    assert len(tokens["received_us"]) == N - 1 and ("api_chunk_us" in tokens) == stream
    if stream:
        assert len(tokens["api_chunk_us"]) == N and tokens["api_chunk_us"] == sorted(tokens["api_chunk_us"])
        assert len(tokens["sent_us"]) == N and last.choices[0].delta.content == "" and last.choices[0].finish_reason


def test_a_timeline_counts_each_chunks_tokens_without_return_token_ids(sdk):
    """The API asks for the output ids to count each chunk's tokens, but shows them only when asked."""
    reply = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi."}], max_tokens=64,
                                        temperature=0, stream=True,
                                        extra_body={"ignore_eos": True, "return_timeline": True})
    chunks = [chunk for chunk in reply if chunk.choices]
    assert all(getattr(chunk.choices[0], "token_ids", None) is None for chunk in chunks)
    # 64 tokens, though some chunks bring none (part of a character) and some several
    assert len(chunks[-1].model_extra["timeline"]["tokens"]["api_chunk_us"]) == 64


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_video_file_url_equals_the_kserve_path(sdk, kserve, media_dir, stream):
    path = media_dir / "openai-clip.mp4"
    if not path.exists():
        make_video(path, 128, 96, 20, 10)
    content = [{"type": "video_url", "video_url": {"url": f"file://{path}"}}, {"type": "text", "text": "Describe."}]
    reply = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=N,
                                        temperature=0, stream=stream, extra_body=EXTRA)
    chunks = list(reply) if stream else []
    ids = _streamed(chunks)[1] if stream else reply.choices[0].token_ids
    theirs = kserve.generate("Describe.", video_url=str(path), sampling=GREEDY, return_output_ids=True)
    assert ids == theirs.token_ids and len(ids) == N
    # what was done with the video, on the reply or the first chunk alone, as the KServe path's first response has it
    media = (chunks[0] if stream else reply).model_extra["media"]
    assert media == theirs.media and media[0]["frames_in_file"] == 20 and media[0]["kind"] == "video"
    assert all(chunk.model_extra.get("media") is None for chunk in chunks[1:])


@pytest.fixture(scope="module")
def hf():
    """The tiny dummy model the server runs, in this process (as tests/e2e/test_generation.py loads it)."""
    return load_model(ModelSpec(device="cuda:0" if torch.cuda.is_available() else "cpu"))


def test_a_conversation_equals_transformers_on_the_chat_template(sdk, hf):
    """System prompt, turns, and an image in the second user turn: the prompt is the tokenizer's own chat template
    over the whole conversation, the image's pixels are flashcodec's, the tokens transformers' generate()."""
    from flashcodec.pipeline import image_group

    model, tokenizer = hf
    image = make_image(96, 64, "RGB", "PNG")
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": [{"type": "text", "text": "Now this:"},
                                     {"type": "image_url", "image_url": {"url": _data_url(image, "image/png")}}]},
    ]
    ours = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=N, temperature=0, extra_body=EXTRA)
    plan = plan_media(MediaInput("image", data=image), RequestParams(), QWEN)
    template = [m if isinstance(m["content"], str) else
                {"role": m["role"], "content": [{"type": "text", "text": "Now this:"}, {"type": "image"}]}
                for m in messages]
    ids = tokenizer.apply_chat_template(template, tokenize=True, add_generation_prompt=True, return_dict=False)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    visual = plan.grid_thw[1] * plan.grid_thw[2] // 4
    ids = [t for token in ids for t in ([token] * visual if token == pad else [token])]
    assert ours.usage.prompt_tokens == len(ids)
    assert ours.model_extra["prompt_token_ids"] == ids  # vLLM's, with return_token_ids: the prompt as it ran
    assert_same_or_tie(ours.choices[0].token_ids,
                       *reference_generate(model, ids, N, image=(image_group(image, plan), plan.grid_thw, 0.0)))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_complete_the_prompt_as_it_is(sdk, hf, stream):
    """A completion's prompt is tokenized as it is (no chat template, special tokens written in it are special, as
    in vLLM's completions): its tokens are transformers' generate() on the tokenizer's ids of that text."""
    model, tokenizer = hf
    prompt = "<|im_start|>system\nOnce upon a time"
    reply = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0, stream=stream,
                                   extra_body=EXTRA, **({"stream_options": {"include_usage": True}} if stream else {}))
    if stream:
        chunks = list(reply)
        ids = [i for c in chunks if c.choices for i in c.choices[0].token_ids]
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
        ran = [c.choices[0].model_extra.get("prompt_token_ids") for c in chunks if c.choices]
        assert all(r is None for r in ran[1:])  # on the choice's first chunk only, as vLLM's
        ran = ran[0]
    else:
        (choice,) = reply.choices
        ids, reason, usage = choice.token_ids, choice.finish_reason, reply.usage
        ran = choice.model_extra["prompt_token_ids"]
    prompt_ids = tokenizer.encode(prompt)
    assert prompt_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ran == prompt_ids  # vLLM's prompt_token_ids, with return_token_ids
    assert (usage.prompt_tokens, reason) == (len(prompt_ids), "length")
    assert_same_or_tie(ids, *reference_generate(model, prompt_ids, N))


def _log_softmax_after(model, prompt_ids: list[int], ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax of the logits that chose each of ``ids`` after ``prompt_ids``: float32 [n, V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids], device=model.device)).logits[0, len(prompt_ids) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_are_transformers_log_softmax_with_the_top_tokens(sdk, hf, stream):
    """``logprobs`` with ``top_logprobs`` 3: per token its text, UTF-8 bytes and log probability, and the 3 most
    likely tokens' (transformers' log-softmax over the chat template's prompt and the reply)."""
    model, tokenizer = hf
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    reply = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=N, temperature=0, stream=stream,
                                        logprobs=True, top_logprobs=3, extra_body=EXTRA)
    choices = [c.choices[0] for c in reply if c.choices] if stream else reply.choices
    ids = [i for c in choices for i in c.token_ids]
    content = [t for c in choices if c.logprobs is not None for t in c.logprobs.content]
    prompt = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    reference = _log_softmax_after(model, prompt, ids)
    assert len(ids) == len(content) == N
    for token, figures, row in zip(ids, content, reference):
        text = tokenizer.decode([token])
        assert (figures.token, figures.bytes) == (text, list(text.encode()))
        assert figures.logprob == pytest.approx(float(row[token]), abs=1e-4)
        top = row.topk(3)
        assert [t.token for t in figures.top_logprobs] == [tokenizer.decode([t]) for t in top.indices.tolist()]
        assert [t.logprob for t in figures.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_are_transformers_log_softmax_with_text_offsets(sdk, hf, stream):
    """Completions' ``logprobs`` 2: tokens, their log probabilities, where each token's text starts (from 0 in a
    whole reply, from the text before it in a streamed chunk, as vLLM anchors them) and the top tokens by text."""
    model, tokenizer = hf
    prompt = "Once upon a time"
    reply = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0, stream=stream,
                                   logprobs=2, extra_body=EXTRA)
    choices = [c.choices[0] for c in reply if c.choices] if stream else reply.choices
    ids = [i for c in choices for i in c.token_ids]
    logprobs = [c.logprobs for c in choices if c.logprobs is not None]
    tokens = [t for lp in logprobs for t in lp.tokens]
    values = [v for lp in logprobs for v in lp.token_logprobs]
    starts = [lp.text_offset[0] for lp in logprobs if lp.text_offset]
    tops = [t for lp in logprobs for t in lp.top_logprobs]
    reference = _log_softmax_after(model, tokenizer.encode(prompt), ids)
    assert tokens == [tokenizer.decode([t]) for t in ids] and len(ids) == N
    assert values == pytest.approx([float(row[t]) for t, row in zip(ids, reference)], abs=1e-4)
    texts = [c.text for c in choices if c.logprobs is not None and c.logprobs.text_offset]
    assert starts == ([sum(map(len, texts[:k])) for k in range(len(texts))] if stream else [0])
    if not stream:
        assert logprobs[0].text_offset == [sum(map(len, tokens[:k])) for k in range(N)]
    for token, top, row in zip(ids, tops, reference):
        best = row.topk(2).indices.tolist()
        assert set(top) == {tokenizer.decode([t]) for t in [token, *best]}


def test_logit_bias_forces_a_token(sdk):
    """OpenAI's ``logit_bias`` (token id strings to biases): +100 on a token makes the greedy reply that token."""
    plain = sdk.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=N, temperature=0,
                                   extra_body=EXTRA).choices[0].token_ids
    forced = sdk.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=N, temperature=0,
                                    logit_bias={str(plain[1]): 100}, extra_body=EXTRA).choices[0].token_ids
    assert forced == [plain[1]] * N


def test_a_client_that_goes_away_has_its_request_cancelled(sdk, server):
    stream = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go on forever."}],
                                         max_tokens=20000, temperature=0, stream=True, extra_body=EXTRA)
    for _, _chunk in zip(range(3), stream):
        pass
    assert_closing_cancels(server, stream)


def test_an_image_under_another_system_prompt_comes_from_the_encoder_cache_and_changes_nothing(sdk, server):
    """The prefix differs from the system prompt on, so only the encoder cache can serve the image: its hits grow by
    the image's tokens, and the reply equals that of the same pixels in other bytes (another identity: encoded)."""
    from io import BytesIO

    from PIL import Image

    from tests.e2e.test_prefix_cache import counters

    image = make_image(120, 88, "RGB", "PNG")
    same_pixels = BytesIO()
    Image.open(BytesIO(image)).save(same_pixels, "PNG", compress_level=0)
    assert same_pixels.getvalue() != image

    def ask(system: str, data: bytes):
        content = [{"type": "image_url", "image_url": {"url": _data_url(data, "image/png")}},
                   {"type": "text", "text": "What is it?"}]
        reply = sdk.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": system},
                                                                   {"role": "user", "content": content}],
                                            max_tokens=N, temperature=0, extra_body=EXTRA)
        assert reply.usage.prompt_tokens_details.cached_tokens < reply.usage.prompt_tokens  # reported, not all
        return reply.choices[0].token_ids, settled(lambda: counters(server))

    _, before = ask("Be brief.", image)
    cached, after = ask("Be kind.", image)
    visual = plan_media(MediaInput("image", data=image), RequestParams(), QWEN).num_tokens
    assert after["encoder_cache_hits_total"] - before["encoder_cache_hits_total"] >= visual > 0
    fresh, later = ask("Be kind.", same_pixels.getvalue())
    assert later["encoder_cache_hits_total"] == after["encoder_cache_hits_total"]
    assert cached == fresh
