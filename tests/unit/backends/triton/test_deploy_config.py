"""Deployment files (backends/triton/deploy_config.py) and the launcher options that use them
(backends/triton/launch_options.py): parsing, checks naming the key, and the repository they render (no server)."""
import argparse
import shlex
import textwrap

import pytest

from backends.triton import launch_options, launcher
from backends.triton.server_binary import HEAP_ENV, THREAD_STACK_BYTES, server_binary, server_command
from backends.triton.deploy_config import DEFAULT_SHM_BYTES, ConfigError, DeployConfig
from backends.triton.launcher import REPO_ROOT
from backends.triton.ports import ServerPorts
from backends.triton.repository import REPOSITORY, model_parameters

EXAMPLES = sorted((REPO_ROOT / "deploy").glob("*.yaml"))


def write(tmp_path, text: str):
    path = tmp_path / "deploy.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def args(**given) -> argparse.Namespace:
    defaults = {"config": None, "model": None, "chat_template": None, "chat_template_content_format": None,
                "overrides": [], "gpu_sharing": None}
    return argparse.Namespace(**{**defaults, **given})


def test_the_examples_check_and_every_item_is_a_repository_parameter():
    assert {p.name for p in EXAMPLES} >= {"qwen2_5_vl_7b_h200.yaml", "tiny_cpu.yaml"}
    for path in EXAMPLES:
        plan = launch_options.serve_plan(args(config=path), REPOSITORY)  # parse_overrides refuses unknown keys
        assert plan.overrides, path


def test_the_h200_example_has_the_papers_budgets_a_memory_share_and_slos():
    config = DeployConfig.load(REPO_ROOT / "deploy" / "qwen2_5_vl_7b_h200.yaml")
    assert (config.budgets.prefill_budget, config.budgets.encode_budget) == (2048, 10240)
    assert config.pools.kv_memory_fraction is not None and config.pools.kv_pages is None
    assert all(getattr(config.slo, m) is not None for m in ("text", "image", "video"))
    overrides = launch_options.serve_plan(args(config=REPO_ROOT / "deploy" / "qwen2_5_vl_7b_h200.yaml"),
                                          REPOSITORY).overrides
    assert overrides["orchestrator"]["slo_video_ttft_ms"] == "15000"
    assert overrides["decode"]["kv_memory_fraction"] == "0.6"
    assert {m: overrides[m]["preset"] for m in overrides if "preset" in overrides[m]} == {
        "orchestrator": "qwen2_5_vl_7b", "encode_prefill": "qwen2_5_vl_7b", "decode": "qwen2_5_vl_7b",
        "flashcodec": "qwen2_5_vl_7b"}


def test_a_file_renders_its_values_and_leaves_the_rest(tmp_path):
    path = write(tmp_path, """
        resources:
          replicas: 2
          encode_prefill: {device: cuda:1, vision_gpus: [0, 1]}
        budgets: {prefill_budget: 4096, max_share: 1, short_prefill_tokens: 0, burst_wait_ms: 20, idle_budget_scale: 4}
        slo:
          image: {ttft_ms: 1500.5, tbt_ms: 40}
        pools: {kv_pages: 100}
    """)
    plan = launch_options.serve_plan(args(config=path), REPOSITORY)
    assert plan.overrides == {
        "orchestrator": {"replicas": "2", "prefill_budget": "4096", "max_share": "1", "short_prefill_tokens": "0",
                         "burst_wait_ms": "20", "idle_budget_scale": "4", "slo_image_ttft_ms": "1500.5",
                         "slo_image_tbt_ms": "40"},
        "encode_prefill": {"device": "cuda:1", "vision_gpus": "0,1"},
        "decode": {"kv_pages": "100", "kv_memory_fraction": ""},  # a fraction in the repository would win
    }
    assert plan.shm_default_byte_size == DEFAULT_SHM_BYTES


def test_an_empty_file_changes_nothing(tmp_path):
    plan = launch_options.serve_plan(args(config=write(tmp_path, "")), REPOSITORY)
    assert plan.overrides == {} and plan.shm_default_byte_size == DEFAULT_SHM_BYTES


@pytest.mark.parametrize("text, key, message", [
    ("pools: {kv_memory_fraction: 1.5}", "pools.kv_memory_fraction", "must be in (0, 1), got 1.5"),
    ("pools: {kv_pages: 10, kv_memory_fraction: 0.5}", "pools.kv_memory_fraction", "not both"),
    ("resources: {decode: {device: cpu}}\npools: {kv_memory_fraction: 0.5}", "pools.kv_memory_fraction",
     "sizes the KV pool from free GPU memory, but resources.decode.device is cpu: set pools.kv_pages instead"),
    ("pools: {kv_pages: 0}", "pools.kv_pages", "must be at least 1, got 0"),
    ("pools: {kv_pages: 10.5}", "pools.kv_pages", "must be an integer or null, got 10.5"),
    ("pools: {kv_pages: true}", "pools.kv_pages", "must be an integer or null, got True"),
    ("budgets: {encode_budget: '10240'}", "budgets.encode_budget", "must be an integer or null"),
    ("budgets: {max_share: 0}", "budgets.max_share", "must be in (0, 1]"),
    ("budgets: {short_prefill_tokens: -1}", "budgets.short_prefill_tokens", "must be at least 0"),
    ("budgets: {burst_wait_ms: -5}", "budgets.burst_wait_ms", "must be at least 0"),
    ("budgets: {idle_budget_scale: 0}", "budgets.idle_budget_scale", "must be at least 1, got 0"),
    ("budgets: {prefill_budgets: 2048}", "budgets.prefill_budgets", "unknown key; known here: prefill_budget"),
    ("slo: {audio: {ttft_ms: 1, tbt_ms: 1}}", "slo.audio", "unknown key; known here: text, image, video"),
    ("slo: {text: {ttft_ms: 100}}", "slo.text.tbt_ms", "missing"),
    ("slo: {text: {ttft_ms: -1, tbt_ms: 5}}", "slo.text.ttft_ms", "must be a positive number of milliseconds"),
    ("slo: {video: 300}", "slo.video", "must be a mapping or null, got 300"),
    ("resources: {decode: {device: gpu0}}", "resources.decode.device", "must be auto, cpu or cuda:N"),
    ("resources: {flashcodec: {nvdec_gpus: [0, 0]}}", "resources.flashcodec.nvdec_gpus", "distinct GPU ids"),
    ("resources: {encode_prefill: {vision_tp_size: some}}", "resources.encode_prefill.vision_tp_size", "all or"),
    ("resources: {encode_prefill: {fewer_sms_kinds: text}}", "resources.encode_prefill.fewer_sms_kinds",
     "must be video, image, video,image, video,text or video,image,text, got 'text'"),
    ("resources: {replicas: 65}", "resources.replicas", "must be at most 64"),
    ("ipc: {shm_default_byte_size: 1}", "ipc.shm_default_byte_size", "must be at least 4194304 (4 MiB, the least"),
    ("slo: {text: {ttft_ms: .inf, tbt_ms: 5}}", "slo.text.ttft_ms", "must be a positive number of milliseconds"),
    # the words the stages load with (triton_io.CHOICES, from backends.runtime.presets), checked at reading
    ("model: {preset: llama}", "model.preset", "must be internvl3_38b, internvl3_8b, internvl3_tiny, qwen2_5_vl_7b "
                                               "or tiny, got 'llama'"),
    ("model: {dtype: int7}", "model.dtype", "must be auto, float32, float16 or bfloat16, got 'int7'"),
    ("model: {load_format: pt}", "model.load_format", "must be auto or dummy, got 'pt'"),
    ("budgets:\n  prefill_budget: 1\n  max_batch: 2\n  prefill_budget: 3", "budgets.prefill_budget",
     "given twice (lines 2 and 4)"),
    ("model: {dtype: float32}\nmodel: {preset: tiny}", "model", "given twice (lines 1 and 2)"),
    ("a: &x [*x]", "a", "unknown key"),  # an alias that holds itself: read once, no endless walk
    ("model: {path: no/such/folder}", "model.path", "is not a directory"),
    ("modle: {preset: tiny}", "modle", "unknown key; known here: model, resources"),
    ("- a list", "the file", "must be a mapping of keys"),
])
def test_bad_values_are_refused_naming_the_file_and_the_key(tmp_path, text, key, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        DeployConfig.load(path)
    assert error.value.key == f"{path}: {key}"
    assert message in error.value.message, error.value.message


def test_a_value_the_repository_refuses_names_the_files_key_not_a_set_item(tmp_path):
    path = write(tmp_path, "budgets: {max_model_len: 99999999999999999999}")
    with pytest.raises(ValueError) as error:
        launch_options.serve_plan(args(config=path), REPOSITORY)
    assert str(error.value).startswith(f"{path}: budgets.max_model_len: orchestrator.max_model_len must fit in 64 "
                                       "bits"), error.value
    assert "--set" not in str(error.value)
    with pytest.raises(ValueError, match=r"^--set 'orchestrator.max_model_len=0': "):  # a --set item: named so
        launch_options.serve_plan(args(overrides=["orchestrator.max_model_len=0"]), REPOSITORY)


def test_unparsable_yaml_names_the_file(tmp_path):
    path = write(tmp_path, "budgets: {prefill_budget: [")
    with pytest.raises(ConfigError, match=f"{path}: cannot read it"):
        DeployConfig.load(path)


def test_sections_are_frozen():
    config = DeployConfig()
    with pytest.raises(AttributeError):
        config.pools.kv_pages = 5


def test_model_path_is_relative_to_the_file_and_model_wins_over_it_and_set_over_both(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "other").mkdir()
    path = write(tmp_path, "model: {path: ckpt, dtype: bfloat16}")
    plan = launch_options.serve_plan(args(config=path), REPOSITORY)
    assert {m: v["model_path"] for m, v in plan.overrides.items()} == {
        m: str(tmp_path / "ckpt") for m in ("decode", "encode_prefill", "orchestrator", "flashcodec")}
    plan = launch_options.serve_plan(args(config=path, model=tmp_path / "other",
                                          overrides=["decode.model_path=/x", "decode.dtype=float16"]), REPOSITORY)
    # a --set naming one stage sets the served model's keys in every stage (repository.MODEL_WIDE)
    assert {m: v["model_path"] for m, v in plan.overrides.items()} == {
        m: "/x" for m in ("decode", "encode_prefill", "orchestrator", "flashcodec")}
    assert (plan.overrides["decode"]["dtype"], plan.overrides["encode_prefill"]["dtype"]) == ("float16", "float16")


def test_model_must_be_a_directory(tmp_path):
    with pytest.raises(ValueError, match="--model .*: not a directory"):
        launch_options.serve_plan(args(model=tmp_path / "missing"), REPOSITORY)


def test_render_writes_the_repository_and_prints_the_command_the_launcher_runs(tmp_path, capsys):
    """``--render`` prints tritonserver's flags from the launcher's own function (server_command): address, ports,
    exit timeout, admin header; then the OpenAI API's command, a comment (a process of its own)."""
    target = tmp_path / "repository"
    options = ["--config", str(REPO_ROOT / "deploy" / "tiny_cpu.yaml"), "--render", str(target)]
    assert launcher.main([*options, "--address", "127.0.0.1", "--http-port", "25500", "--admin-header", "X-A=b"]) == 0
    binary, backends, env = server_binary()  # here the pip wheel's: its backends and libraries are named too
    server, api = capsys.readouterr().out.splitlines()
    assert shlex.split(server) == [
        "ulimit", "-s", f"{THREAD_STACK_BYTES >> 10};",  # Triton's HTTP threads' stacks (server_binary)
        *(f"{key}={value}" for key, value in {**HEAP_ENV, **env}.items()),
        *server_command(binary, backends, target, ServerPorts(25500, 8001, 8002, "127.0.0.1"), 2**24,
                        admin_header=("x-a", "b"))]
    assert {"--http-address=127.0.0.1", "--http-port=25500", "--grpc-address=127.0.0.1", "--grpc-port=8001",
            "--metrics-port=8002", "--exit-timeout-secs=10"} <= set(shlex.split(server))
    assert api.startswith("# then") and "-m backends.openai --grpc-url 127.0.0.1:8001 --host 127.0.0.1 --port 9000" \
        in api, api
    rendered = model_parameters(target)
    assert rendered["decode"]["kv_pages"] == "2048" and rendered["orchestrator"]["slo_text_ttft_ms"] == "2000"
    assert launcher.main(options) == 2  # not over a repository already there
    assert "not empty" in capsys.readouterr().err
    options[-1] = str(tmp_path / "no_api")
    assert launcher.main([*options, "--openai-port", "0"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1  # no API


def test_gpu_sharing_and_sm_shares_come_from_the_file_and_the_option_wins(tmp_path):
    path = write(tmp_path, """
        resources:
          gpu_sharing: mps
          decode: {sm_share: 40}
          encode_prefill: {sm_share: 100, mps_priority: below_normal}
    """)
    plan = launch_options.serve_plan(args(config=path), REPOSITORY)
    assert plan.gpu_sharing == "mps"
    assert plan.overrides["decode"]["sm_share"] == "40" and plan.overrides["encode_prefill"]["sm_share"] == "100"
    assert plan.overrides["encode_prefill"]["mps_priority"] == "below_normal"
    assert launch_options.serve_plan(args(config=path, gpu_sharing="time_slicing"), REPOSITORY).gpu_sharing == \
        "time_slicing"
    assert launch_options.serve_plan(args(), REPOSITORY).gpu_sharing == "time_slicing"


@pytest.mark.parametrize("text, key", [("resources: {gpu_sharing: mig}", "resources.gpu_sharing"),
                                       ("resources: {decode: {sm_share: 0}}", "resources.decode.sm_share"),
                                       ("resources: {flashcodec: {sm_share: 120}}", "resources.flashcodec.sm_share"),
                                       ("resources: {encode_prefill: {mps_priority: low}}",
                                        "resources.encode_prefill.mps_priority")])
def test_bad_gpu_sharing_or_sm_share_is_refused_by_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        DeployConfig.load(write(tmp_path, text))


def test_fewer_sms_kinds_in_a_file_and_in_set_reach_the_orchestrator(tmp_path):
    """``resources.encode_prefill.fewer_sms_kinds`` (a string in YAML, commas and all) becomes the orchestrator's
    parameter beside ``sms_while_decoding``; ``--set`` is checked against the same words."""
    path = write(tmp_path, """
        resources:
          encode_prefill:
            sms_while_decoding: 88
            fewer_sms_kinds: video,image
    """)
    overrides = launch_options.serve_plan(args(config=path), REPOSITORY).overrides
    assert overrides["orchestrator"] == {"fewer_sms_kinds": "video,image"}
    assert overrides["encode_prefill"] == {"sms_while_decoding": "88"}
    for value in ("image", "video", "video,text"):
        plan = launch_options.serve_plan(args(overrides=[f"orchestrator.fewer_sms_kinds={value}"]), REPOSITORY)
        assert plan.overrides["orchestrator"] == {"fewer_sms_kinds": value}
    with pytest.raises(ValueError, match="fewer_sms_kinds must be video, image, video,image, video,text or video,image,text, "
                                         "got 'audio'"):
        launch_options.serve_plan(args(overrides=["orchestrator.fewer_sms_kinds=audio"]), REPOSITORY)
