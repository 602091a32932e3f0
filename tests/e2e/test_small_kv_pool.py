"""A small KV pool (64 pages of 16 tokens): a request it can never hold is refused at admission with the numbers a
user can act on; replies whose worst cases together overfill the pool all start, their pages granted as they grow,
each making what it makes alone; a prompt whose pages would leave a running reply unable to reach its max_tokens waits,
and the metrics say so; beyond `max_waiting_requests` (2 here) waiting requests, a new one is refused at once as
overloaded. A request whose max_tokens is null (an OpenAI chat request without it) gets the rest of the context, at
most `default_max_tokens` (40 here)."""
from __future__ import annotations

import threading
import time

import pytest

from client.api import Client, ServerError
from tests.e2e.conftest import openai_sdk, read_metrics, repository_with, serve, wait_for_idle_pools

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def small_pool_server(media_dir, tmp_path_factory):
    repository = repository_with(tmp_path_factory.mktemp("small_pool") / "repository",
                                 {"decode": {"kv_pages": "64"},
                                  "orchestrator": {"max_waiting_requests": "2", "default_max_tokens": "40"}})
    with serve(media_dir, repository) as server:
        yield server


def test_the_kv_gauges_show_the_pool_before_any_request(small_pool_server):
    """The orchestrator starts its engines at load (the first test of the module: no request was sent yet)."""
    deadline = time.monotonic() + 30
    while (m := read_metrics(small_pool_server))["unifiedserve_kv_pages_total"] == 0:
        assert time.monotonic() < deadline, "the KV gauges read 0 with no request sent"
        time.sleep(0.1)
    assert m["unifiedserve_kv_pages_total"] == m["unifiedserve_kv_pages_free"] == 64  # decode.kv_pages
    assert m["unifiedserve_patch_pages_total"] > 0


def test_a_request_larger_than_the_kv_pool_names_its_prompt_and_max_tokens(small_pool_server):
    with Client(f"127.0.0.1:{small_pool_server.ports.grpc}") as client:
        with pytest.raises(ServerError) as error:
            client.generate("Tell me a story.", sampling={"max_tokens": 2000})
        message = str(error.value)
        assert "max_tokens (2000)" in message and "tokens, text and visual" in message and "KV pages" in message
        assert client.generate("Hi", sampling={"max_tokens": 2, "ignore_eos": True}).num_output_tokens == 2


def test_a_null_max_tokens_is_default_max_tokens_over_kserve_and_for_an_openai_chat_without_it(
        small_pool_server, tmp_path):
    """vLLM's chat runs to the end of the context without max_tokens; here at most default_max_tokens (40). A
    completion request's default stays 16 (vLLM's), and a min_tokens above the
    limit chosen is refused naming it."""
    with Client(f"127.0.0.1:{small_pool_server.ports.grpc}") as client:
        result = client.generate("Go on.", sampling={"max_tokens": None, "ignore_eos": True})
        assert (result.num_output_tokens, result.finish_reason) == (40, "length")
        with pytest.raises(ServerError) as refused:
            client.generate("Go on.", sampling={"max_tokens": None, "min_tokens": 41})
        assert "min_tokens 41 is more than this reply may have without max_tokens: 40 tokens, the server's " \
               "default_max_tokens 40" in str(refused.value)
        with pytest.raises(ServerError) as pool_full:  # 1,100 tokens: the context has room, the 64-page pool not
            client.generate("Go on. " * 360, sampling={"max_tokens": None})
        assert "needs" in str(pool_full.value) and "with one token of output" in str(pool_full.value)
        assert "max_tokens" not in str(pool_full.value)
    with openai_sdk(small_pool_server, tmp_path) as openai_client:
        chat = openai_client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Go on."}], extra_body={"ignore_eos": True})
        assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (40, "length")
        completion = openai_client.completions.create(model="tiny", prompt="Go on.", extra_body={"ignore_eos": True})
        assert (completion.usage.completion_tokens, completion.choices[0].finish_reason) == (16, "length")
    wait_for_idle_pools(small_pool_server)


LONG_PROMPT = "Go on. " * 110  # about 690 tokens of the tiny model: 44 pages


def test_replies_whose_worst_cases_overfill_the_pool_all_start_and_make_what_they_make_alone(small_pool_server):
    """Three replies of 600 tokens (39 pages each at worst, 117 in all) start at once in the 64 pages: decode takes
    pages as they are written, a reply waiting for one while another could not finish otherwise (the gauge
    `unifiedserve_requests_waiting_for_page` counts it). Each streams the tokens of the same request alone."""
    url = f"127.0.0.1:{small_pool_server.ports.grpc}"
    sampling = {"max_tokens": 600, "ignore_eos": True, "temperature": 0}
    with Client(url) as client:
        alone = client.generate("Go on.", sampling=sampling, return_output_ids=True).token_ids
    results, seen = {}, []

    def generate(name: str) -> None:
        with Client(url) as client:
            results[name] = client.generate("Go on.", sampling=sampling, return_output_ids=True).token_ids

    threads = [threading.Thread(target=generate, args=(f"r{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        m = read_metrics(small_pool_server)
        seen.append((m["unifiedserve_num_requests_waiting"], m["unifiedserve_num_requests_running"],
                     m["unifiedserve_requests_waiting_for_page"]))
        time.sleep(0.05)
    assert (0, 3, 0) in seen and all(waiting == 0 for waiting, _, _ in seen), seen
    assert any(for_page > 0 for _, _, for_page in seen), "no reply waited for a page: the pool was never short"
    assert len(alone) == 600 and all(results[f"r{i}"] == alone for i in range(3))
    wait_for_idle_pools(small_pool_server)


def test_a_request_that_does_not_fit_yet_waits_is_counted_and_a_short_one_goes_ahead(small_pool_server):
    """The first request may come to hold 51 of the 64 pages (prompt + 800 tokens); the second, a prompt of 44
    pages, would leave it short of them, so it waits: `unifiedserve_num_requests_waiting` reads 1 while `_running`
    counts both, and it runs once the first has ended. A short request sent meanwhile does not wait behind it (its
    worst case fits in what the pool leaves over beside the second's)."""
    url = f"127.0.0.1:{small_pool_server.ports.grpc}"
    results = {}

    def generate(name: str, prompt: str, max_tokens: int) -> None:
        with Client(url) as client:
            results[name] = client.generate(prompt, sampling={"max_tokens": max_tokens, "ignore_eos": True,
                                                              "temperature": 0})

    first = threading.Thread(target=generate, args=("first", "Go on.", 800))
    first.start()
    while read_metrics(small_pool_server)["unifiedserve_num_requests_running"] < 1 and first.is_alive():
        time.sleep(0.02)
    second = threading.Thread(target=generate, args=("second", LONG_PROMPT, 100))
    second.start()
    seen = []
    while first.is_alive():
        m = read_metrics(small_pool_server)
        seen.append((m["unifiedserve_num_requests_waiting"], m["unifiedserve_num_requests_running"]))
        time.sleep(0.05)
        if seen[-1] == (1, 2) and "short" not in results:
            with Client(url) as client:
                results["short"] = client.generate("Hi", sampling={"max_tokens": 4, "ignore_eos": True})
            short_done_while_first_ran = first.is_alive()
    first.join()
    second.join(timeout=120)
    assert (1, 2) in seen, seen
    assert results["short"].num_output_tokens == 4 and short_done_while_first_ran
    assert results["first"].num_output_tokens == 800 and results["second"].num_output_tokens == 100
    m = wait_for_idle_pools(small_pool_server)
    assert m["unifiedserve_num_requests_waiting"] == 0 and m["unifiedserve_num_requests_running"] == 0, m


def test_beyond_max_waiting_requests_a_request_is_refused_at_once_as_overloaded(small_pool_server):
    """One request may come to hold most of the pool, two long prompts wait for pages (the limit): a fourth is
    refused at once with UNAVAILABLE naming the limit, not queued; the three others still finish, and every page
    comes back."""
    url = f"127.0.0.1:{small_pool_server.ports.grpc}"
    results = {}

    def generate(name: str, prompt: str, max_tokens: int) -> None:
        with Client(url) as client:
            try:
                results[name] = client.generate(prompt, sampling={"max_tokens": max_tokens, "ignore_eos": True,
                                                                  "temperature": 0})
            except ServerError as exc:
                results[name] = exc

    threads = [threading.Thread(target=generate, args=args)
               for args in (("first", "Go on.", 800), ("second", LONG_PROMPT, 100), ("third", LONG_PROMPT, 100))]
    threads[0].start()
    while read_metrics(small_pool_server)["unifiedserve_num_requests_running"] < 1 and threads[0].is_alive():
        time.sleep(0.02)
    for thread in threads[1:]:
        thread.start()
    while read_metrics(small_pool_server)["unifiedserve_num_requests_waiting"] < 2 and threads[0].is_alive():
        time.sleep(0.02)
    assert threads[0].is_alive(), "the first request ended before the others waited"
    started = time.monotonic()
    with Client(url) as client, pytest.raises(ServerError) as refused:
        client.generate("One more.", sampling={"max_tokens": 4})
    # at once: while the first request still holds the pages the others wait for (a queued request would wait for
    # them); the time bound is loose, for a loaded 2-core machine (it was 1 s)
    assert threads[0].is_alive() and time.monotonic() - started < 5.0, "the refusal waited for pages"
    assert "the server is overloaded: 2 requests wait for KV pages" in str(refused.value)
    assert "max_waiting_requests" in str(refused.value)
    for thread in threads:
        thread.join(timeout=300)
    assert all(results[name].num_output_tokens > 0 for name in ("first", "second", "third")), results
    wait_for_idle_pools(small_pool_server)
