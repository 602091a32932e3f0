"""``python -m backends.openai [--grpc-url 127.0.0.1:8001] [--port 9000] [--workers 1] ...``: the OpenAI-compatible
API, served by uvicorn until SIGTERM or Ctrl-C (then requests in flight get ``--shutdown-grace`` seconds to end). The
app is built by :func:`app_from_env` from the command line passed on in ``CONFIG_ENV`` (and the keys of ``--api-key``
in ``api_keys.ENV``), so that with ``--workers N`` each of the N processes on the port (``backends.openai.workers``)
builds its own."""
from __future__ import annotations

import json
import os
import sys

import uvicorn

from backends.gc_heap import freeze_startup_heap, watch_collections
from backends.openai import workers
from backends.openai.app import create_app
from backends.openai.config import parse_args

CONFIG_ENV = "UNIFIEDSERVE_OPENAI_ARGS"


def app_from_env():
    """A worker's app, from the command line its parent put in ``CONFIG_ENV`` (JSON list); the process's heap is
    then frozen and its long garbage collections logged (``backends.gc_heap``)."""
    app = create_app(parse_args(json.loads(os.environ[CONFIG_ENV])))
    freeze_startup_heap()
    watch_collections(f"openai-api[{os.getpid()}]")
    return app


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    # workers are new processes: they read the command line there, and the keys (--api-key), which it leaves out
    os.environ.update({CONFIG_ENV: json.dumps(config.to_args()), **config.env()})
    if config.workers > 1:  # a listening socket each (backends.openai.workers), not uvicorn's shared one
        try:
            sys.exit(workers.serve(config))
        except (RuntimeError, OSError) as exc:  # the port is taken
            sys.exit(f"OpenAI API: cannot serve on {config.host}:{config.port}: {exc}")
    uvicorn.run("backends.openai.__main__:app_from_env", factory=True, host=config.host, port=config.port,
                timeout_graceful_shutdown=config.shutdown_grace_s)


if __name__ == "__main__":
    main()
