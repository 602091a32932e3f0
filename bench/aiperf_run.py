"""aiperf against UnifiedServe's OpenAI-compatible API: a short streamed chat run with synthetic text on a CPU server
with the tiny model (seeded random weights), the report written to results/aiperf-cpu-<date>/ beside this script.

Usage: ``python bench/aiperf_run.py [--aiperf /path/to/aiperf] [--requests 40] [--concurrency 4] [--out DIR]``.

aiperf lives in a virtual environment of its own: it requires Pillow 12 and NumPy 2, the server's environment pins
Pillow 11 and NumPy 1 (Triton 2.51's Python backend). ``python3 -m venv /tmp/aiperf-venv &&
/tmp/aiperf-venv/bin/pip install -r requirements/aiperf.txt``, then ``--aiperf /tmp/aiperf-venv/bin/aiperf``.

The server starts on free ports with the repository's model_repository (``TritonServer``), the API beside it
(``ApiProcess``). aiperf counts tokens as the server reports them (``--use-server-token-count``: the random model's
bytes do not decode to text that re-tokenizes to the same count) and loads the offline tokenizer, saved to a
temporary folder (nothing can be downloaded), to make its synthetic prompts. Requests are greedy with
``ignore_eos``, so every reply is exactly ``--output-tokens`` tokens.
"""
from __future__ import annotations

import argparse
import datetime
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from backends.openai.config import ApiConfig  # noqa: E402
from backends.openai.process import ApiProcess  # noqa: E402
from backends.runtime.tokenizer import build_offline_tokenizer  # noqa: E402
from backends.triton.launcher import REPO_ROOT, TritonServer  # noqa: E402
from backends.triton.ports import ServerPorts  # noqa: E402
from bench.common import header, write  # noqa: E402

KEEP = "profile_export_aiperf"  # its summary (.json, .csv); its logs, inputs and manifest stay out of the repository
SERVING = ("tritonclient", "fastapi", "uvicorn", "sse-starlette", "pydantic", "openai")


def aiperf_command(aiperf: str, url: str, tokenizer: Path, out: Path, args: argparse.Namespace) -> list[str]:
    return [aiperf, "profile", "--model", "tiny", "--url", url, "--endpoint-type", "chat", "--streaming",
            "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
            "--warmup-request-count", str(args.concurrency),
            "--prompt-input-tokens-mean", str(args.input_tokens), "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(args.output_tokens), "--prompt-output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
            "--tokenizer", str(tokenizer), "--use-server-token-count", "--random-seed", "0",
            "--output-artifact-dir", str(out), "--export-level", "summary", "--ui-type", "none"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf executable (its own virtual environment)")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="default: results/aiperf-cpu-<date> beside this script")
    args = parser.parse_args()
    out = args.out or REPO_ROOT / "bench" / "results" / f"aiperf-cpu-{datetime.date.today().isoformat()}"
    version = subprocess.run([args.aiperf, "--version"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="aiperf-run-") as tmp:
        tokenizer = Path(tmp) / "tokenizer"
        build_offline_tokenizer().save_pretrained(tokenizer)
        ports = ServerPorts.unused()
        with TritonServer(REPO_ROOT / "model_repository", ports=ports) as server, \
                ApiProcess(ApiConfig(grpc_url=f"127.0.0.1:{ports.grpc}", port=ServerPorts.unused().http),
                           Path(tmp) / "api.log") as api:
            command = aiperf_command(args.aiperf, api.url, tokenizer, Path(tmp) / "aiperf", args)
            print(" ".join(command), flush=True)
            status = subprocess.run(command).returncode
            log_tail = server.log_tail(2000)
        if status != 0:
            print(f"aiperf exited with {status}; the server log ends with:\n{log_tail}", file=sys.stderr)
            return status
        out.mkdir(parents=True, exist_ok=True)
        for path in sorted((Path(tmp) / "aiperf").rglob("*")):
            if path.stem == KEEP:
                shutil.copy(path, out / path.name)
    write(out, "run", {**header(torch.device("cpu")), "serving": {name: metadata.version(name) for name in SERVING},
                       "aiperf": version, "command": " ".join(command).replace(tmp, "<tmp>")})
    print(f"report in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
