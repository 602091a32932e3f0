"""The launcher's --openai-* options (backends/triton/openai_options.py): the API's settings they make, and counts
below their least refused at once."""
import argparse

import pytest

from backends.triton import openai_options


def _parsed(*argv: str) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    openai_options.add_arguments(parser)
    return parser, parser.parse_args(argv)


def test_the_api_listens_where_asked_and_reaches_a_server_on_every_address_over_the_loopback():
    config = openai_options.api_config(_parsed("--address", "0.0.0.0", "--grpc-port", "9101", "--openai-port", "9200",
                                               "--openai-workers", "2", "--openai-no-token-channel")[1])
    assert (config.grpc_url, config.host, config.port) == ("127.0.0.1:9101", "0.0.0.0", 9200)
    assert config.workers == 2 and not config.token_channel and not config.allow_http_media
    config = openai_options.api_config(_parsed("--address", "10.0.0.5", "--openai-address", "127.0.0.1")[1])
    assert (config.grpc_url, config.host) == ("10.0.0.5:8001", "127.0.0.1")


def test_the_api_reads_the_servers_metrics_for_its_health_over_the_loopback_when_on_every_address():
    config = openai_options.api_config(_parsed("--address", "0.0.0.0", "--metrics-port", "9102")[1])
    assert config.metrics_url == "http://127.0.0.1:9102/metrics"
    assert openai_options.api_config(_parsed("--address", "10.0.0.5")[1]).metrics_url == "http://10.0.0.5:8002/metrics"
    assert openai_options.api_config(_parsed("--address", "::1")[1]).metrics_url == "http://[::1]:8002/metrics"


def test_the_served_model_names_reach_the_api(capsys):
    """vLLM's --served-model-name, several names: the API takes each, replies with the first; an empty one is a usage
    error at once."""
    assert openai_options.api_config(_parsed()[1]).served_model_names == ()
    parser, args = _parsed("--served-model-name", "qwen", "Qwen/Qwen2.5-VL-7B-Instruct")
    openai_options.check(parser, args)
    assert openai_options.api_config(args).served_model_names == ("qwen", "Qwen/Qwen2.5-VL-7B-Instruct")
    parser, args = _parsed("--served-model-name", "")
    with pytest.raises(SystemExit):
        openai_options.check(parser, args)
    assert "--served-model-name must not be empty" in capsys.readouterr().err


def test_the_allowed_origins_reach_the_api():
    assert openai_options.api_config(_parsed()[1]).allowed_origins == ("*",)  # vLLM's default
    assert openai_options.api_config(_parsed("--allowed-origins")[1]).allowed_origins == ()
    assert openai_options.api_config(_parsed("--allowed-origins", "https://ui.example")[1]).allowed_origins == (
        "https://ui.example",)


def test_request_id_headers_reach_the_api():
    assert not openai_options.api_config(_parsed()[1]).request_id_headers  # vLLM's default: off
    assert openai_options.api_config(_parsed("--enable-request-id-headers")[1]).request_id_headers


def test_the_api_keys_reach_the_api(monkeypatch, capsys):
    """vLLM's --api-key, else $UNIFIEDSERVE_API_KEY (comma-separated); an empty key is a usage error at once."""
    monkeypatch.delenv("UNIFIEDSERVE_API_KEY", raising=False)
    assert openai_options.api_config(_parsed()[1]).api_keys == ()
    assert openai_options.api_config(_parsed("--api-key", "k1", "k2")[1]).api_keys == ("k1", "k2")
    monkeypatch.setenv("UNIFIEDSERVE_API_KEY", "k3,k4")
    assert openai_options.api_config(_parsed()[1]).api_keys == ("k3", "k4")
    parser, args = _parsed("--api-key", "")
    with pytest.raises(SystemExit):
        openai_options.check(parser, args)
    assert "--api-key must be non-empty and hold no comma" in capsys.readouterr().err


@pytest.mark.parametrize("option,value", [("--openai-workers", "0"), ("--openai-max-body-bytes", "0"),
                                          ("--openai-max-requests", "-1")])
def test_a_count_below_its_least_is_a_usage_error(option, value, capsys):
    parser, args = _parsed(option, value)
    with pytest.raises(SystemExit):
        openai_options.check(parser, args)
    assert f"{option} must be at least" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "65536"])
def test_an_openai_port_outside_0_to_65535_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit):
        _parsed("--openai-port", value)
    assert f"--openai-port: {value} is not a TCP port: use 1..65535 (0: no API)" in capsys.readouterr().err
    assert _parsed("--openai-port", "0")[1].openai_port == 0
