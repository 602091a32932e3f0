"""``python -m backends.openai [--grpc-url 127.0.0.1:8001] [--port 9000] ...``: the OpenAI-compatible API, served by
uvicorn until SIGTERM or Ctrl-C (then requests in flight get ``--shutdown-grace`` seconds to end)."""
from __future__ import annotations

import uvicorn

from backends.openai.app import create_app
from backends.openai.config import parse_args


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    uvicorn.run(create_app(config), host=config.host, port=config.port,
                timeout_graceful_shutdown=config.shutdown_grace_s)


if __name__ == "__main__":
    main()
