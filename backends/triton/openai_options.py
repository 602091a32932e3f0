"""The launcher's ``--openai-*`` options: the OpenAI-compatible API started beside tritonserver, and the
:class:`~backends.openai.config.ApiConfig` they make."""
from __future__ import annotations

import argparse

from backends.openai.api_keys import keys_from_env
from backends.openai.config import ApiConfig, FieldError
from backends.openai.process import default_openai_workers
from backends.triton.ports import optional_port_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--openai-port", type=optional_port_option, default=9000,
                        help="the OpenAI-compatible API's port (default 9000; 0: no API)")
    parser.add_argument("--openai-address", default=None, help="where the OpenAI API listens (default: --address)")
    parser.add_argument("--served-model-name", nargs="+", default=(), metavar="NAME",
                        help="the model names the OpenAI API's clients may send, the first in its replies (vLLM's "
                             "option; default: the checkpoint folder's name, or its path as loaded, else the preset)")
    parser.add_argument("--api-key", nargs="+", default=(), metavar="KEY",
                        help="keys an OpenAI API request must carry one of as 'Authorization: Bearer KEY' (vLLM's "
                             "option; handed to the API by its environment; default: $UNIFIEDSERVE_API_KEY, "
                             "comma-separated, else none)")
    parser.add_argument("--allowed-origins", nargs="*", default=ApiConfig.allowed_origins, metavar="ORIGIN",
                        help="origins whose browser pages may call the OpenAI API (CORS, vLLM's option; default: any, "
                             "*; the option alone: none)")
    parser.add_argument("--enable-request-id-headers", action="store_true",
                        help="an X-Request-Id header on every OpenAI API answer: the request's own, else a random "
                             "one (vLLM's option)")
    parser.add_argument("--openai-allow-http-media", action="store_true",
                        help="let the OpenAI API fetch http(s) image_url / video_url parts (off: refused)")
    parser.add_argument("--openai-workers", type=int, default=default_openai_workers(),
                        help="processes serving the OpenAI API (each with its own connection to tritonserver; "
                             "default: one per 4 CPU cores, at most 4)")
    parser.add_argument("--openai-max-requests", type=int, default=0,
                        help="OpenAI API requests in flight at once per worker, more are answered 503 (0: no limit)")
    parser.add_argument("--openai-no-token-channel", action="store_true",
                        help="the API's streamed requests each on their own gRPC stream, not over a token channel")
    parser.add_argument("--openai-max-body-bytes", type=int, default=ApiConfig.max_body_bytes,
                        help="the largest OpenAI API request body, in bytes; larger ones are answered 413")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Ends the launcher with a usage error naming its option for a setting the API's config refuses
    (``ApiConfig``: checked at once, not once the models have loaded)."""
    try:
        api_config(args)
    except FieldError as exc:
        parser.error(f"{FLAGS[exc.name]} {exc.why}")


# the launcher's option for each API setting it passes that a FieldError may name
FLAGS = {"port": "--openai-port", "api_keys": "--api-key", "served_model_names": "--served-model-name",
         "workers": "--openai-workers", "max_body_bytes": "--openai-max-body-bytes",
         "max_requests": "--openai-max-requests"}


def api_config(args: argparse.Namespace) -> ApiConfig:
    """The API's settings: it listens at ``--openai-address`` (else ``--address``) and reaches tritonserver's gRPC
    port, and its metrics port for ``/health`` (``backends.openai.replica_health``), over the loopback when the
    server listens on every address. ``args``: the launcher's, with ``--address`` and its ports."""
    local = "127.0.0.1" if args.address in ("0.0.0.0", "::") else args.address
    metrics_host = f"[{local}]" if ":" in local else local  # an IPv6 address in a URL
    return ApiConfig(grpc_url=f"{local}:{args.grpc_port}", host=args.openai_address or args.address,
                     port=args.openai_port, served_model_names=tuple(args.served_model_name),
                     api_keys=tuple(args.api_key) or keys_from_env(), allowed_origins=tuple(args.allowed_origins),
                     request_id_headers=args.enable_request_id_headers,
                     allow_http_media=args.openai_allow_http_media,
                     max_requests=args.openai_max_requests, workers=args.openai_workers,
                     max_body_bytes=args.openai_max_body_bytes, token_channel=not args.openai_no_token_channel,
                     metrics_url=f"http://{metrics_host}:{args.metrics_port}/metrics")
