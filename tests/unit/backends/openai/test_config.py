"""The API's settings (backends/openai/config.py): the command line the launcher writes reads back the same."""
from __future__ import annotations

import pytest

from backends.openai.config import FLAGS, ApiConfig, FieldError, parse_args


def test_the_command_line_reads_back_the_config():
    config = ApiConfig(grpc_url="10.0.0.2:8101", host="0.0.0.0", port=9100,
                       served_model_names=("qwen", "Qwen/Qwen2.5-VL-7B-Instruct"), allow_http_media=True,
                       max_http_media_bytes=1000, http_image_timeout_s=2.5, http_video_timeout_s=12.0,
                       shutdown_grace_s=1.0, max_requests=8, workers=3, token_channel=False,
                       metrics_url="http://127.0.0.1:8102/metrics", request_id_headers=True)
    assert parse_args(config.to_args()) == config
    assert parse_args(ApiConfig().to_args()) == ApiConfig()


@pytest.mark.parametrize("settings", [dict(port=70000), dict(max_http_media_bytes=0), dict(http_image_timeout_s=0),
                                      dict(http_video_timeout_s=-1), dict(shutdown_grace_s=-1),
                                      dict(served_model_names=("qwen", " ")), dict(max_requests=-1), dict(workers=0),
                                      dict(metrics_url="127.0.0.1:8002/metrics"), dict(metrics_url=""),
                                      dict(max_body_bytes=0), dict(api_keys=("a,b",))])
def test_bad_settings_are_refused_and_the_command_line_names_its_option(settings, capsys):
    (name, value), = settings.items()
    with pytest.raises(FieldError) as refused:
        ApiConfig(**settings)
    assert refused.value.name == name
    words = list(value) if isinstance(value, tuple) else [str(value)]
    with pytest.raises(SystemExit):
        parse_args([FLAGS[name], *words])
    assert f"error: {FLAGS[name]} {refused.value.why}" in capsys.readouterr().err
