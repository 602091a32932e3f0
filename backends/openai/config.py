"""The OpenAI-compatible API process's settings (its command line, ``python -m backends.openai --help``)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from backends.openai.api_keys import ENV as API_KEY_ENV, keys_from_env


class FieldError(ValueError):
    """A setting :class:`ApiConfig` refuses: ``name`` (its field) and ``why`` ("must be at least 1, got 0"), so
    that each command line names its own option (:data:`FLAGS`, ``backends.triton.openai_options``)."""

    def __init__(self, name: str, why: str):
        super().__init__(f"{name} {why}")
        self.name, self.why = name, why


# this process's option for each field a FieldError may name
FLAGS = {"port": "--port", "max_http_media_bytes": "--max-http-media-bytes", "max_requests": "--max-requests",
         "http_image_timeout_s": "--http-image-timeout", "http_video_timeout_s": "--http-video-timeout",
         "shutdown_grace_s": "--shutdown-grace", "api_keys": "--api-key", "served_model_names": "--served-model-name",
         "workers": "--workers", "max_body_bytes": "--max-body-bytes", "metrics_url": "--metrics-url"}


@dataclass(frozen=True)
class ApiConfig:
    """Where the API listens and which orchestrator it speaks to.

    ``grpc_url``: tritonserver's gRPC endpoint (host:port); ``host``/``port``: where the API listens;
    ``orchestrator_model``: the Triton model requests go to; ``served_model_names``: the ``model`` names clients may
    send, the first the one replies carry (vLLM's ``--served-model-name``; none: the orchestrator's checkpoint folder
    name, else its preset, read from Triton's model config, the checkpoint's path as loaded also taken);
    ``allow_http_media``: fetch http(s) ``image_url``/``video_url`` parts in this process (off: refused), at most
    ``max_http_media_bytes`` bytes each within ``http_image_timeout_s`` / ``http_video_timeout_s`` seconds (vLLM's
    ``VLLM_IMAGE_FETCH_TIMEOUT`` and ``VLLM_VIDEO_FETCH_TIMEOUT`` defaults); ``shutdown_grace_s``: seconds
    requests in flight may still run after a stop is asked for; ``max_requests``: requests in flight at once, more
    are answered 503 (0: no limit; the orchestrator queues what its KV pool cannot hold yet), counted per worker;
    ``workers``: processes serving the API on the one port (each with its own listening socket, the kernel
    spreading connections over them: ``backends.openai.workers``; and its own connection to tritonserver), for when
    one Python process cannot keep up with the streams' chunks (vLLM's ``--api-server-count``); ``max_body_bytes``:
    the largest request body taken (bytes), larger ones are answered 413 before they are read
    (``backends.openai.body_limit``; the default holds a 3-minute 720p video inline in base64 several times over);
    ``token_channel``: streamed requests' replies over the process's token channel (``backends.openai.token_channel``;
    off: each request's own stream carries them, one response per token); ``metrics_url``: tritonserver's Prometheus
    metrics (e.g. ``http://127.0.0.1:8002/metrics``), with which ``/health`` also answers 503 once every replica has
    ended (``backends.openai.replica_health``; None: by readiness alone); ``api_keys``: the keys a request must
    carry one of (``backends.openai.api_keys``; none: any request is served), out of the command line and the repr;
    ``allowed_origins``: the origins whose browser pages may call the API (CORS, Starlette's middleware; ``*``: any,
    vLLM's default; none: no CORS headers, so browsers refuse other origins' calls); ``request_id_headers``: every
    answer carries an ``X-Request-Id`` header, the request's own or a random one (vLLM's
    ``--enable-request-id-headers``: ``backends.openai.request_ids``).

    Raises FieldError (a ValueError) naming the field: a port outside 0..65535, a size, timeout or count below its
    least, an empty API key or one holding a comma, an empty served model name, a ``metrics_url`` that is not
    http(s).
    """

    grpc_url: str = "127.0.0.1:8001"
    host: str = "127.0.0.1"
    port: int = 9000
    orchestrator_model: str = "orchestrator"
    served_model_names: tuple[str, ...] = ()
    allow_http_media: bool = False
    max_http_media_bytes: int = 64 * 1024 * 1024
    http_image_timeout_s: float = 5.0
    http_video_timeout_s: float = 30.0
    shutdown_grace_s: float = 5.0
    max_requests: int = 0
    workers: int = 1
    max_body_bytes: int = 256 * 1024 * 1024
    token_channel: bool = True
    metrics_url: str | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    allowed_origins: tuple[str, ...] = ("*",)
    request_id_headers: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise FieldError("port", f"must be in 0..65535, got {self.port}")
        for name, least in (("max_body_bytes", 1), ("max_http_media_bytes", 1), ("workers", 1), ("max_requests", 0),
                            ("shutdown_grace_s", 0)):
            if getattr(self, name) < least:
                raise FieldError(name, f"must be at least {least}, got {getattr(self, name)}")
        for name in ("http_image_timeout_s", "http_video_timeout_s"):
            if not getattr(self, name) > 0:
                raise FieldError(name, f"must be positive, got {getattr(self, name)}")
        if any(not key or "," in key for key in self.api_keys):
            raise FieldError("api_keys", "must be non-empty and hold no comma")
        if any(not name.strip() for name in self.served_model_names):
            raise FieldError("served_model_names", f"must not be empty, got {list(self.served_model_names)}")
        if self.metrics_url is not None and not self.metrics_url.startswith(("http://", "https://")):
            raise FieldError("metrics_url", f"must be an http(s) URL, got {self.metrics_url!r}")

    def to_args(self) -> list[str]:
        """The command line that :func:`parse_args` reads back into this config, with :meth:`env` (the keys)."""
        args = ["--grpc-url", self.grpc_url, "--host", self.host, "--port", str(self.port),
                "--orchestrator-model", self.orchestrator_model,
                "--max-http-media-bytes", str(self.max_http_media_bytes),
                "--http-image-timeout", str(self.http_image_timeout_s),
                "--http-video-timeout", str(self.http_video_timeout_s), "--shutdown-grace", str(self.shutdown_grace_s),
                "--max-requests", str(self.max_requests), "--workers", str(self.workers),
                "--max-body-bytes", str(self.max_body_bytes)]
        if self.served_model_names:
            args += ["--served-model-name", *self.served_model_names]
        if self.allow_http_media:
            args.append("--allow-http-media")
        if not self.token_channel:
            args.append("--no-token-channel")
        if self.metrics_url is not None:
            args += ["--metrics-url", self.metrics_url]
        if self.request_id_headers:
            args.append("--enable-request-id-headers")
        return args + ["--allowed-origins", *self.allowed_origins]

    def env(self) -> dict[str, str]:
        """The environment the API process needs beside :meth:`to_args`: the keys (``api_keys.ENV``), if any."""
        return {API_KEY_ENV: ",".join(self.api_keys)} if self.api_keys else {}


def parse_args(argv: list[str] | None = None) -> ApiConfig:
    """An :class:`ApiConfig` from a command line (exits with a usage message on a bad one)."""
    d = ApiConfig()
    parser = argparse.ArgumentParser(prog="python -m backends.openai",
                                     description="OpenAI-compatible HTTP API in front of UnifiedServe's orchestrator")
    parser.add_argument("--grpc-url", default=d.grpc_url, help="tritonserver's gRPC endpoint")
    parser.add_argument("--host", default=d.host, help="0.0.0.0 to serve other machines")
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--orchestrator-model", default=d.orchestrator_model)
    parser.add_argument("--served-model-name", nargs="+", default=(), metavar="NAME",
                        help="the model names clients may send, the first in replies (vLLM's; default: the "
                             "checkpoint folder's name, or its path as loaded, else the preset)")
    parser.add_argument("--allow-http-media", action="store_true",
                        help="fetch http(s) image_url / video_url parts (off: they are refused)")
    parser.add_argument("--max-http-media-bytes", type=int, default=d.max_http_media_bytes)
    parser.add_argument("--http-image-timeout", type=float, default=d.http_image_timeout_s,
                        help="seconds for the whole fetch of one http(s) image (vLLM's VLLM_IMAGE_FETCH_TIMEOUT)")
    parser.add_argument("--http-video-timeout", type=float, default=d.http_video_timeout_s,
                        help="seconds for the whole fetch of one http(s) video (vLLM's VLLM_VIDEO_FETCH_TIMEOUT)")
    parser.add_argument("--shutdown-grace", type=float, default=d.shutdown_grace_s,
                        help="seconds requests in flight may run on after SIGTERM")
    parser.add_argument("--max-requests", type=int, default=d.max_requests,
                        help="requests in flight at once per worker, more are answered 503 (0: no limit)")
    parser.add_argument("--workers", type=int, default=d.workers,
                        help="processes serving the API on its port (each with its own connection to tritonserver)")
    parser.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                        help="the largest request body taken, in bytes; larger ones are answered 413")
    parser.add_argument("--no-token-channel", action="store_true",
                        help="each streamed request's tokens on its own gRPC stream, not over the process's token "
                             "channel (one response a step for all its requests)")
    parser.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help=f"keys a request must carry one of as 'Authorization: Bearer KEY' (vLLM's option; "
                             f"default: ${API_KEY_ENV}, comma-separated, else none and every request is served)")
    parser.add_argument("--allowed-origins", nargs="*", default=d.allowed_origins, metavar="ORIGIN",
                        help="origins whose browser pages may call the API (CORS; default: any, *, as vLLM's; "
                             "the option alone: none)")
    parser.add_argument("--metrics-url", default=None, metavar="URL",
                        help="tritonserver's Prometheus metrics, e.g. http://127.0.0.1:8002/metrics: /health and /ping "
                             "then also answer 503 once every replica has ended (unifiedserve_replica_serving all 0; "
                             "default: by tritonserver's readiness alone)")
    parser.add_argument("--enable-request-id-headers", action="store_true",
                        help="an X-Request-Id header on every answer: the request's own, else a random one (vLLM's)")
    a = parser.parse_args(argv)
    try:
        return ApiConfig(a.grpc_url, a.host, a.port, a.orchestrator_model, tuple(a.served_model_name),
                         a.allow_http_media, a.max_http_media_bytes, a.http_image_timeout, a.http_video_timeout,
                         a.shutdown_grace, a.max_requests, a.workers, a.max_body_bytes, not a.no_token_channel,
                         a.metrics_url, tuple(a.api_key) if a.api_key is not None else keys_from_env(),
                         tuple(a.allowed_origins), a.enable_request_id_headers)
    except FieldError as exc:
        parser.error(f"{FLAGS[exc.name]} {exc.why}")
