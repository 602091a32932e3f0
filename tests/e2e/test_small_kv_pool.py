"""A request the KV pool can never hold is refused at admission with the numbers a user can act on."""
from __future__ import annotations

import pytest

from client.api import Client, ServerError
from tests.e2e.conftest import repository_with, serve

pytestmark = pytest.mark.e2e


def test_a_request_larger_than_the_kv_pool_names_its_prompt_and_max_tokens(media_dir, tmp_path):
    repository = repository_with(tmp_path / "repository", {"decode": {"kv_pages": "64"}})  # 64 x 16 tokens
    with serve(media_dir, repository) as server, Client(f"127.0.0.1:{server.ports.grpc}") as client:
        with pytest.raises(ServerError) as error:
            client.generate("Tell me a story.", sampling={"max_tokens": 2000})
        message = str(error.value)
        assert "max_tokens (2000)" in message and "tokens, text and visual" in message and "KV pages" in message
        assert client.generate("Hi", sampling={"max_tokens": 2}).num_output_tokens == 2
