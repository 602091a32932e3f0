"""The launcher's options that decide what is served: ``--config`` (a deployment file, ``deploy_config``),
``--model`` (every model's checkpoint), ``--chat-template`` and ``--chat-template-content-format`` (the orchestrator's
``chat_template`` and ``chat_template_content_format``), then ``--set`` (each later one wins over what came before),
``--gpu-sharing`` (over the file's ``resources.gpu_sharing``), and
``--render DIR`` (write the repository and the tritonserver command that serves it as the launcher would, and start
nothing).
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from backends.openai.config import ApiConfig
from backends.openai.process import REPO_ROOT
from backends.triton.deploy_config import DeployConfig
from backends.triton.mps import CONTROL, GPU_SHARING
from backends.triton.ports import ServerPorts
from backends.triton.repository import parse_overrides, repository_with
from backends.triton.server_binary import HEAP_ENV, THREAD_STACK_BYTES, server_binary, server_command
from backends.triton.triton_io import CHOICES
from orchestrator.served_template import load_chat_template


@dataclass(frozen=True)
class ServePlan:
    """What to serve: ``overrides`` ({model: {key: value}}, ``repository.parse_overrides``) of the source
    repository's parameters, the Python backend's shared-memory region per model process (bytes), and how the
    model processes share a GPU (``backends.triton.mps.GPU_SHARING``)."""

    overrides: dict[str, dict[str, str]]
    shm_default_byte_size: int
    gpu_sharing: str = "time_slicing"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="DEPLOY.yaml",
                        help="a deployment file (deploy/*.yaml): resources, budgets, SLOs, pools, IPC buffer")
    parser.add_argument("--model", type=Path, metavar="PATH",
                        help="a local Qwen2.5-VL or InternVL3 checkpoint directory: the model_path of every model")
    parser.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                        help="the chat template of every chat, instead of the checkpoint's, as vLLM's --chat-template: "
                             "a Jinja file, or the template itself; it reads a message's content as a list of parts, "
                             "as the model's own does, or as one string (--chat-template-content-format)")
    parser.add_argument("--chat-template-content-format", choices=CHOICES["chat_template_content_format"],
                        help="how the chat template takes a message's content, as vLLM's flag: openai (a list of "
                             "parts), string (one string: each image's or video's placeholder on a line, then the "
                             "texts) or auto (told from the template: a loop over the content takes parts; default)")
    parser.add_argument("--gpu-sharing", choices=GPU_SHARING,
                        help="how the model processes share a GPU: time_slicing (CUDA's default) or mps (CUDA MPS "
                             "started for the server, SM shares from each stage's sm_share); default: the "
                             "deployment file's resources.gpu_sharing, else time_slicing")
    parser.add_argument("--admin-header", type=admin_header_option, metavar="NAME=VALUE",
                        help="only requests carrying this header may change the server's log and trace settings "
                             "(Triton's /v2/logging and trace APIs; over gRPC its metadata key is "
                             "triton-grpc-protocol-NAME); without it any client may")
    parser.add_argument("--render", type=Path, metavar="DIR",
                        help="write the model repository to DIR (new or empty), print the tritonserver command "
                             "that serves it with this launcher's flags (address, ports, --admin-header, ...) and "
                             "the OpenAI API's, and exit")


def admin_header_option(text: str) -> tuple[str, str]:
    """``--admin-header NAME=VALUE`` as (name in lower case, as gRPC sends metadata keys; value). Raises
    argparse.ArgumentTypeError for a name that is not a header name or a value Triton's flag and gRPC metadata cannot
    carry (empty, not printable ASCII, spaces, commas, colons, equals signs)."""
    name, _, value = text.partition("=")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]*", name) or not re.fullmatch(r"[!-~]+", value) or \
            re.search(r"[,:=]", value):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE: a header name (letters, digits, '-') and a value of "
                                         f"printable ASCII without spaces, ',', ':' or '=', got {text!r}")
    return name.lower(), value


def template_option(value: str) -> str:
    """``--chat-template``'s value for the orchestrator's ``chat_template`` parameter: a file's absolute path (the
    server's working folder differs), or a template as it is. Raises ValueError naming the option where the value
    is empty or looks like a file path (``served_template.JINJA_CHARS``) and is no file, or the template does not
    compile."""
    if not value.strip():
        raise ValueError("--chat-template: empty (name a template file, or leave the option out for the model's own)")
    try:
        if Path(value).is_file():
            value = str(Path(value).resolve())
    except OSError:  # a template longer than a file name may be: the template itself
        pass
    try:
        load_chat_template(value)
    except ValueError as exc:
        raise ValueError(f"--chat-template: {str(exc).removeprefix('parameter chat_template: ')}") from None
    return value


def serve_plan(args: argparse.Namespace, source: Path) -> ServePlan:
    """The plan from ``args`` (``--config``, ``--model``, ``--set`` as ``args.overrides``) for the repository
    ``source``. Raises ValueError naming the option at fault: a deployment file that does not check
    (``deploy_config.ConfigError``), a ``--model`` that is not a directory, a ``--chat-template`` that
    :func:`template_option` refuses, a ``--set`` item that
    ``parse_overrides`` refuses (a file's value that the repository refuses names the file's key)."""
    config = DeployConfig.load(args.config) if args.config else DeployConfig()
    keyed = [(f"{args.config}: {key}", item) for key, item in config.keyed_items()]
    if args.model is not None:
        if not args.model.is_dir():
            raise ValueError(f"--model {args.model}: not a directory (a local Qwen2.5-VL or InternVL3 checkpoint)")
        keyed.append(("--model", f"*.model_path={args.model.resolve()}"))  # the server's working folder differs
    if args.chat_template is not None:
        keyed.append(("--chat-template", f"orchestrator.chat_template={template_option(args.chat_template)}"))
    if args.chat_template_content_format is not None:
        keyed.append(("--chat-template-content-format",
                      f"orchestrator.chat_template_content_format={args.chat_template_content_format}"))
    keyed += [(None, item) for item in args.overrides]  # named as --set items
    sharing = args.gpu_sharing or config.resources.gpu_sharing or "time_slicing"
    overrides = parse_overrides([item for _, item in keyed], source, [origin for origin, _ in keyed])
    return ServePlan(overrides, config.ipc.shm_default_byte_size, sharing)


def render(plan: ServePlan, source: Path, target: Path, ports: ServerPorts,
           admin_header: tuple[str, str] | None = None, api: ApiConfig | None = None) -> int:
    """Write ``source`` with ``plan``'s parameters to ``target`` (its model.py files link to ``source``'s) and
    print the command that serves it as the launcher would (``server_binary.server_command``: the same flags, on
    ``ports``, with the launcher's ``HEAP_ENV`` and thread stacks), then, with ``api``, a comment with the command of
    the OpenAI-compatible API (a process of its own, which the launcher starts once the server is ready). Returns
    the exit status: 0, or 2 (a bad argument) when ``target`` holds files already."""
    if target.exists() and any(target.iterdir()):
        print(f"--render {target}: not empty", file=sys.stderr, flush=True)
        return 2  # a bad argument, as argparse's status
    target.mkdir(parents=True, exist_ok=True)
    repository_with(target.resolve(), plan.overrides, source)
    try:  # the binary found here: NGC's, or the pip wheel's, which needs its backends and libraries named
        binary, backends, env = server_binary()
    except RuntimeError:  # none here: the command for an NGC image, where tritonserver is on PATH
        binary, backends, env = Path("tritonserver"), None, {}
    command = server_command(binary, backends if env else None, target.resolve(), ports, plan.shm_default_byte_size,
                             admin_header=admin_header)
    if plan.gpu_sharing == "mps":  # the launcher's daemon is not part of a rendered command
        print(f"# gpu_sharing mps: start the MPS daemon ({CONTROL} -d) first, with CUDA_MPS_PIPE_DIRECTORY and "
              "CUDA_MPS_LOG_DIRECTORY set for it and for this command", flush=True)
    prefix = "".join(f"{key}={shlex.quote(value)} " for key, value in {**HEAP_ENV, **env}.items())
    stack = f"ulimit -s {THREAD_STACK_BYTES >> 10}; "  # the launcher's thread stacks (server_binary)
    print(stack + prefix + shlex.join(command), flush=True)
    if api is not None:
        print(f"# then, once it is ready, the OpenAI-compatible API (a process of its own), from {REPO_ROOT}: "
              f"{shlex.join([sys.executable, '-m', 'backends.openai', *api.to_args()])}", flush=True)
    return 0
