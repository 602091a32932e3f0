"""backends/triton/repository.py and the launcher's --set: model parameters changed in a copy (no server)."""
from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from backends.triton import launcher
from backends.triton.repository import REPOSITORY, edited_config, model_parameters, parse_overrides, repository_with
from backends.triton.triton_io import CHOICES, POSITIVE_INT_PARAMETERS, int_parameter


def test_star_sets_the_key_in_every_model_that_declares_it():
    overrides = parse_overrides(["*.preset=qwen2_5_vl_7b", "*.dtype=bfloat16", "decode.kv_pages=16384"])
    assert overrides == {"decode": {"preset": "qwen2_5_vl_7b", "dtype": "bfloat16", "kv_pages": "16384"},
                         "encode_prefill": {"preset": "qwen2_5_vl_7b", "dtype": "bfloat16"},
                         "orchestrator": {"preset": "qwen2_5_vl_7b"}, "flashcodec": {"preset": "qwen2_5_vl_7b"}}


def test_later_items_win_and_values_may_hold_equals_signs():
    assert parse_overrides(["decode.kv_pages=1", "decode.kv_pages=2", "orchestrator.allowed_media_dirs=/m=1"]) == {
        "decode": {"kv_pages": "2"}, "orchestrator": {"allowed_media_dirs": "/m=1"}}


@pytest.mark.parametrize("argv, message", [
    (["--http-port", "70000"], "argument --http-port: 70000 is not a TCP port: use 1..65535"),
    (["--grpc-port", "-1"], "argument --grpc-port: -1 is not a TCP port"),
    (["--http-port", "9100", "--grpc-port", "9100"], "--http-port and --grpc-port are both 9100"),
    (["--openai-port", "8000"], "--http-port and --openai-port are both 8000"),
    (["--openai-port", "8000", "--openai-address", "127.0.0.1"], "--http-port and --openai-port are both 8000"),
    (["--openai-port", "8000", "--address", "0.0.0.0", "--openai-address", "127.0.0.2"], "are both 8000"),
])
def test_bad_or_shared_ports_stop_the_launcher_before_starting(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(launcher, "_serve", lambda *a: pytest.fail("the server must not start"))
    with pytest.raises(SystemExit) as e:
        launcher.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("item, message", [
    ("decode.no_such_key=1", "model 'decode' has no parameter 'no_such_key'; its parameters: device"),
    ("nomodel.preset=tiny", "no model 'nomodel'"),
    ("*.no_such_key=1", "no model has a parameter 'no_such_key'"),
    ("decode.preset", "expected MODEL.KEY=VALUE"),
    ("preset=tiny", "expected MODEL.KEY=VALUE"),
])
def test_unknown_or_malformed_items_are_errors_naming_them(item, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_overrides([item])


def _without(parameters: dict, pairs: set) -> dict:
    return {m: {k: v for k, v in keys.items() if (m, k) not in pairs} for m, keys in parameters.items()}


def test_copy_has_the_new_values_and_links_the_rest(tmp_path):
    repository_with(tmp_path, {"decode": {"preset": "qwen2_5_vl_7b", "model_path": 'a "b"\\c'}})
    changed, original = model_parameters(tmp_path), model_parameters()
    assert changed["decode"]["preset"] == "qwen2_5_vl_7b"
    assert changed["decode"]["model_path"] == 'a \\"b\\"\\\\c'  # pbtxt-escaped as written
    edited = {("decode", "preset"), ("decode", "model_path")}
    assert _without(changed, edited) == _without(original, edited)
    for model in original:
        model_py = tmp_path / model / "1" / "model.py"
        assert model_py.is_symlink() and model_py.resolve() == (REPOSITORY / model / "1" / "model.py").resolve()
    # Everything but the edited parameter line is unchanged.
    before = (REPOSITORY / "decode" / "config.pbtxt").read_text().splitlines()
    after = (tmp_path / "decode" / "config.pbtxt").read_text().splitlines()
    assert [n for n, (a, b) in enumerate(zip(before, after)) if a != b] == [
        n for n, line in enumerate(before) if '"preset"' in line or '"model_path"' in line]


def test_commented_out_parameters_are_not_parameters():
    config = ('# parameters { key: "x" value { string_value: "1" } }\n'
              'parameters { key: "x" value { string_value: "2" } }\n')
    assert edited_config(config, {"x": "3"}).splitlines()[1] == 'parameters { key: "x" value { string_value: "3" } }'
    with pytest.raises(ValueError, match="'y'"):
        edited_config(config, {"y": "3"})


def test_repository_with_refuses_unknown_models(tmp_path):
    with pytest.raises(ValueError, match="no model 'nomodel'"):
        repository_with(tmp_path, {"nomodel": {"preset": "tiny"}})


def test_launcher_set_serves_the_edited_copy_and_removes_it(monkeypatch):
    served = {}

    def fake_serve(args, repository, plan):
        served["parameters"] = model_parameters(repository)
        served["repository"] = repository
        served["shm"] = plan.shm_default_byte_size
        return 0

    monkeypatch.setattr(launcher, "_serve", fake_serve)
    assert launcher.main(["--set", "*.dtype=bfloat16", "--set", "decode.kv_pages=16384"]) == 0
    assert served["parameters"]["encode_prefill"]["dtype"] == served["parameters"]["decode"]["dtype"] == "bfloat16"
    assert served["parameters"]["decode"]["kv_pages"] == "16384"
    assert not served["repository"].exists()  # the copy lives while the server runs
    assert launcher.main([]) == 0 and served["repository"] == REPOSITORY  # no --set: the repo's own
    # a deployment file, with --set over it; its IPC buffer size goes to the server's command line
    assert launcher.main(["--config", str(REPOSITORY.parent / "deploy" / "qwen2_5_vl_7b_h200.yaml"),
                          "--set", "decode.max_batch=32"]) == 0
    assert served["parameters"]["orchestrator"]["encode_budget"] == "10240"
    assert served["parameters"]["decode"]["max_batch"] == "32" and served["shm"] == 64 * 2**20


def test_the_api_on_another_address_may_take_a_servers_port_number(monkeypatch):
    monkeypatch.setattr(launcher, "_serve", lambda *a: 0)
    assert launcher.main(["--openai-port", "8000", "--openai-address", "127.0.0.2"]) == 0


def test_launcher_set_with_an_unknown_key_stops_before_starting(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "_serve", lambda *a: pytest.fail("the server must not start"))
    with pytest.raises(SystemExit) as e:
        launcher.main(["--set", "decode.kv_page=16"])
    assert e.value.code == 2 and "model 'decode' has no parameter 'kv_page'" in capsys.readouterr().err


@pytest.mark.parametrize("item, message", [
    ("decode.kv_pages=abc", "decode.kv_pages must be an integer, got 'abc'"),
    ("decode.kv_pages=", "decode.kv_pages must be an integer, got an empty value"),
    ("decode.kv_pages=-5", "decode.kv_pages must be a positive integer, got '-5'"),
    ("decode.kv_pages=99999999999999999999", "decode.kv_pages must fit in 64 bits (|value| below 2**63), got "
                                             "'99999999999999999999'"),
    ("*.seed=-9223372036854775809", "decode.seed must fit in 64 bits"),
    ("flashcodec.patch_pages=0", "flashcodec.patch_pages must be a positive integer, got '0'"),
    ("orchestrator.max_model_len=1.5", "orchestrator.max_model_len must be an integer, got '1.5'"),
    ("*.seed=x", "decode.seed must be an integer, got 'x'"),
    ("encode_prefill.sms_while_decoding=-1", "encode_prefill.sms_while_decoding must be 0 or more, got '-1'"),
    ("encode_prefill.prefill_graphs=maybe", "encode_prefill.prefill_graphs must be auto, on or off, got 'maybe'"),
    ("decode.cuda_graphs=yes", "decode.cuda_graphs must be auto, on or off, got 'yes'"),
    ("decode.share_weights=auto", "decode.share_weights must be on or off, got 'auto'"),
    ("orchestrator.slo_text_tbt_ms=fast", "orchestrator.slo_text_tbt_ms must be a positive number (or empty: unset), "
                                          "got 'fast'"),
    ("*.gil_switch_interval_ms=0", "decode.gil_switch_interval_ms must be a positive number of at most 1000 (or empty: "
                                   "unset), got '0'"),
    ("*.gil_switch_interval_ms=1e9", "decode.gil_switch_interval_ms must be a positive number of at most 1000"),
    ("orchestrator.slo_video_ttft_ms=-3", "orchestrator.slo_video_ttft_ms must be a positive number"),
    ("orchestrator.slo_image_tbt_ms=nan", "orchestrator.slo_image_tbt_ms must be a positive number"),
    # the served model's words, the lists ModelSpec loads with (backends.runtime.presets)
    ("decode.dtype=int7", "decode.dtype must be auto, float32, float16 or bfloat16, got 'int7'"),
    ("*.preset=llama", "decode.preset must be internvl3_38b, internvl3_8b, internvl3_tiny, qwen2_5_vl_7b or tiny"),
    ("*.load_format=safetensors", "decode.load_format must be auto or dummy, got 'safetensors'"),
])
def test_values_a_model_cannot_load_with_are_refused_before_start(item, message):
    with pytest.raises(ValueError, match=re.escape(f"--set '{item}': {message}")):
        parse_overrides([item])


def test_integer_checks_follow_the_repository_and_leave_other_values_alone():
    assert parse_overrides(["*.seed=-1", "decode.kv_pages=8", "orchestrator.allowed_media_dirs=",
                            "decode.dtype=bfloat16", "orchestrator.slo_text_tbt_ms=25.5",
                            "orchestrator.slo_video_ttft_ms="]) == {
        "decode": {"seed": "-1", "kv_pages": "8", "dtype": "bfloat16"},
        "encode_prefill": {"seed": "-1", "dtype": "bfloat16"},
        "orchestrator": {"allowed_media_dirs": "", "slo_text_tbt_ms": "25.5",
                                                           "slo_video_ttft_ms": ""}}


def test_every_word_parameter_in_the_repository_has_its_choices_and_its_default_among_them():
    declared = {(m, k): v for m, keys in model_parameters().items() for k, v in keys.items()}
    for (model, key), default in declared.items():
        if key in CHOICES:
            assert default in CHOICES[key], (model, key)
    assert {k for _, k in declared} >= CHOICES.keys()


def test_every_size_or_count_in_the_repository_is_checked_for_positivity():
    declared = {k: v for keys in model_parameters().values() for k, v in keys.items()}
    sizes = {"kv_pages", "kv_page_size", "max_batch", "patch_pages", "patch_page_size", "decode_threads",
             "encode_budget", "prefill_budget", "max_model_len", "max_media_bytes"}
    assert sizes <= declared.keys() and sizes <= POSITIVE_INT_PARAMETERS


@pytest.mark.parametrize("value, message", [
    ("abc", "parameter kv_pages must be an integer, got 'abc'"),
    ("", "parameter kv_pages must be an integer, got an empty value"),
    ("0", "parameter kv_pages must be a positive integer, got '0'"),
])
def test_stages_read_integer_parameters_with_errors_naming_them(value, message):
    with pytest.raises(ValueError, match=message):
        int_parameter({"kv_pages": value}, "kv_pages")
    with pytest.raises(ValueError, match="parameter kv_pages is missing"):
        int_parameter({}, "kv_pages")
    assert int_parameter({"kv_pages": " 16 "}, "kv_pages") == 16 and int_parameter({}, "kv_pages", 4) == 4
    assert int_parameter({"seed": "-3"}, "seed") == -3


def test_replicas_are_written_as_named_copies(tmp_path):
    repository_with(tmp_path, parse_overrides(["orchestrator.replicas=3", "decode.kv_pages=64"]))
    params = model_parameters(tmp_path)
    for k in (1, 2):
        for stage in ("encode_prefill", "decode"):
            name = f"{stage}_r{k}"
            config = (tmp_path / name / "config.pbtxt").read_text()
            assert re.search(rf'^name: "{name}"$', config, re.MULTILINE) and params[name]["replica"] == str(k)
            assert (tmp_path / name / "1" / "model.py").resolve() == (REPOSITORY / stage / "1" / "model.py").resolve()
        assert params[f"decode_r{k}"]["kv_pages"] == "64"  # the stage's overrides hold for every replica
    assert params["decode"]["replica"] == "0" and not (tmp_path / "decode_r3").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*model_parameters(), "decode_r1", "decode_r2", "encode_prefill_r1", "encode_prefill_r2"])
    with pytest.raises(ValueError, match="orchestrator.replicas must be a positive integer"):
        parse_overrides(["orchestrator.replicas=0"])
    with pytest.raises(ValueError, match="orchestrator.replicas must be at most 64, got '100000'"):
        parse_overrides(["orchestrator.replicas=100000"])


def test_fractional_parameters_take_fractions():
    # the prefix cache's region, as docs/deployment.md sets it (its defaults are written as fractions for this)
    assert parse_overrides(["orchestrator.prefix_cache_floor=0.1", "orchestrator.prefix_cache_ceiling=0.5"]) == {
        "orchestrator": {"prefix_cache_floor": "0.1", "prefix_cache_ceiling": "0.5"}}


@pytest.mark.parametrize("items, expected", [
    ([], "on"),
    (["decode.share_weights=off"], "off"),
    (["encode_prefill.share_weights=off"], "off"),
    (["*.share_weights=on", "decode.share_weights=off"], "off"),
    (["decode.share_weights=off", "encode_prefill.share_weights=on"], "on"),  # the later item wins, for both
])
def test_encode_prefill_learns_whether_decode_shares_its_weights(tmp_path, items, expected):
    """encode_prefill gives its language model no memory when decode shares its copy, so the two must agree."""
    written = model_parameters(repository_with(tmp_path, parse_overrides(items)))
    assert written["decode"]["share_weights"] == written["encode_prefill"]["share_weights"] == expected


def test_the_served_models_keys_set_every_stage_that_has_them():
    """One model is served: a seed or dtype named for one stage is every stage's (a fresh user's find: decode.seed=7
    alone made the answer depend on share_weights; decode.dtype alone failed every request)."""
    overrides = parse_overrides(["decode.seed=7", "encode_prefill.dtype=bfloat16", "decode.preset=internvl3_tiny"])
    assert overrides["decode"]["seed"] == overrides["encode_prefill"]["seed"] == "7"
    assert overrides["decode"]["dtype"] == overrides["encode_prefill"]["dtype"] == "bfloat16"
    assert {m for m, values in overrides.items() if values.get("preset") == "internvl3_tiny"} == {
        "decode", "encode_prefill", "flashcodec", "orchestrator"}


def test_the_copy_holds_each_model_py_bytecode_so_that_loading_it_writes_nothing_there(tmp_path, monkeypatch):
    """The stub's import of a version folder's model.py finds its bytecode valid and writes none: the repository does
    not change under Triton (poll mode reloaded every model when it did). Without the file, the import writes it."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    target = repository_with(tmp_path / "repo", {})
    models = sorted(target.glob("*/1/model.py"))
    assert len(models) == 4
    for model_py in models:
        cache = model_py.parent / "__pycache__"
        before = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
        spec = importlib.util.spec_from_file_location(f"probe_{model_py.parent.parent.name}", model_py)
        spec.loader.get_code(spec.name)  # what the stub's import does before running the module
        assert before and {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == before
    for pyc in cache.iterdir():
        pyc.unlink()
    spec.loader.get_code(spec.name)
    assert [p.name for p in cache.iterdir()] == list(before)
