"""The encode_prefill stage's ``prefill_graphs`` option: checked before the model loads, ``on`` refused at load where
flashinfer cannot run, and what ``auto`` picks on a CPU; the parameter as the repository and a deployment file
declare it; ``sms_while_decoding`` as they declare it (its checks at load: test_step_streams.py); ``vision_graphs``
and ``compile_layers`` the same way."""
import textwrap

import pytest
import torch

from backends.ipc import shared_tensor
from backends.ipc.run_dir import RUN_DIR_ENV
from backends.runtime.language_model.kv_cache import KVCacheLayout
from backends.runtime.loader import ModelSpec
from backends.stages.encode_prefill_worker import EncodePrefillWorker
from backends.triton.deploy_config import ConfigError, DeployConfig
from backends.triton.repository import model_parameters, parse_overrides


@pytest.fixture(autouse=True)
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))


def test_a_bad_value_is_named():
    with pytest.raises(ValueError, match="prefill_graphs must be auto, on or off, got 'yes'"):
        EncodePrefillWorker(ModelSpec(), torch.device("cpu"), prefill_graphs="yes")


@pytest.mark.parametrize("backend, reason", [("auto", "flashinfer needs a CUDA device, got cpu"),
                                             ("torch", "attention_backend is torch")])
def test_on_without_flashinfer_is_refused_at_load_with_the_reason(backend, reason):
    with pytest.raises(ValueError, match=f"prefill_graphs=on needs the flashinfer attention backend: {reason}"):
        EncodePrefillWorker(ModelSpec(), torch.device("cpu"), attention_backend=backend, prefill_graphs="on")


@pytest.mark.parametrize("option", ["auto", "off"])
def test_the_cpu_prefills_eagerly(option):
    worker = EncodePrefillWorker(ModelSpec(), torch.device("cpu"), prefill_graphs=option)
    layout = KVCacheLayout.from_config(worker.model.config, num_pages=8, page_size=16)
    pool = shared_tensor.create("kv_pool", layout.shape, layout.dtype, torch.device("cpu"))
    try:
        assert worker.runner.prefill_graphs is None
    finally:
        worker.shutdown()
        pool.release()


def test_the_repository_declares_it_and_a_deployment_file_sets_it(tmp_path):
    assert model_parameters()["encode_prefill"]["prefill_graphs"] == "auto"
    assert parse_overrides(["encode_prefill.prefill_graphs=off"]) == {"encode_prefill": {"prefill_graphs": "off"}}
    path = tmp_path / "deploy.yaml"
    for text, value in [("prefill_graphs: auto", "auto"), ("prefill_graphs: off", "off"),  # YAML's off: a bool
                        ("prefill_graphs: 'on'", "on")]:
        path.write_text(f"resources:\n  encode_prefill: {{{text}}}\n")
        config = DeployConfig.load(path)
        assert config.resources.encode_prefill.prefill_graphs == value
        assert f"encode_prefill.prefill_graphs={value}" in config.set_items()
    path.write_text(textwrap.dedent("""
        resources:
          encode_prefill: {prefill_graphs: sometimes}
    """))
    with pytest.raises(ConfigError, match="resources.encode_prefill.prefill_graphs: must be auto, on or off"):
        DeployConfig.load(path)


def test_the_repository_declares_sms_while_decoding_off_and_a_deployment_file_sets_it(tmp_path):
    assert model_parameters()["encode_prefill"]["sms_while_decoding"] == "0"
    assert parse_overrides(["encode_prefill.sms_while_decoding=66"]) == {"encode_prefill": {"sms_while_decoding": "66"}}
    with pytest.raises(ValueError, match="encode_prefill.sms_while_decoding must be an integer, got 'half'"):
        parse_overrides(["encode_prefill.sms_while_decoding=half"])
    path = tmp_path / "deploy.yaml"
    path.write_text("resources:\n  encode_prefill: {sms_while_decoding: 66}\n")
    config = DeployConfig.load(path)
    assert config.resources.encode_prefill.sms_while_decoding == 66
    assert "encode_prefill.sms_while_decoding=66" in config.set_items()
    for value, message in [("-8", "must be 0 \\(off\\) or a number of SMs, got -8"), ("half", "")]:
        path.write_text(f"resources:\n  encode_prefill: {{sms_while_decoding: {value}}}\n")
        with pytest.raises(ConfigError, match=f"resources.encode_prefill.sms_while_decoding: {message}"):
            DeployConfig.load(path)


def test_vision_graphs_on_where_they_cannot_run_is_refused_at_load_with_the_reason():
    with pytest.raises(ValueError, match="vision_graphs must be auto, on or off, got 'yes'"):
        EncodePrefillWorker(ModelSpec(), torch.device("cpu"), vision_graphs="yes")
    with pytest.raises(ValueError, match="vision_graphs=on: the device is not a GPU"):
        EncodePrefillWorker(ModelSpec(), torch.device("cpu"), vision_graphs="on")


def test_the_cpu_encodes_without_vision_graphs():
    worker = EncodePrefillWorker(ModelSpec(), torch.device("cpu"))  # auto
    layout = KVCacheLayout.from_config(worker.model.config, num_pages=8, page_size=16)
    pool = shared_tensor.create("kv_pool", layout.shape, layout.dtype, torch.device("cpu"))
    try:
        assert worker.vision_graphs is False and worker.runner.vision_graphs is None
    finally:
        worker.shutdown()
        pool.release()


@pytest.mark.parametrize("key", ["vision_graphs", "compile_layers"])
def test_the_repository_declares_the_switch_and_a_deployment_file_sets_it(tmp_path, key):
    assert model_parameters()["encode_prefill"][key] == "auto"
    path = tmp_path / "deploy.yaml"
    for text, value in [(f"{key}: off", "off"), (f"{key}: auto", "auto")]:
        path.write_text(f"resources:\n  encode_prefill: {{{text}}}\n")
        assert getattr(DeployConfig.load(path).resources.encode_prefill, key) == value
        assert f"encode_prefill.{key}={value}" in DeployConfig.load(path).set_items()
    path.write_text(f"resources:\n  encode_prefill: {{{key}: always}}\n")
    with pytest.raises(ConfigError, match=f"resources.encode_prefill.{key}: must be auto, on or off"):
        DeployConfig.load(path)
    with pytest.raises(ValueError, match=key):
        parse_overrides([f"encode_prefill.{key}=always"])


@pytest.mark.parametrize("option, compiled", [("auto", False), ("off", False), ("on", True)])
def test_the_decoder_layers_are_compiled_with_flashinfer_or_when_asked(option, compiled, caplog):
    """``auto`` on the CPU (torch attention): eager layers; ``on``: every decoder layer compiled (lazily: by its first
    call), and the log says which. The compiled layers' output equals the eager layers': test_compile.py."""
    with pytest.raises(ValueError, match="compile_layers must be auto, on or off, got 'yes'"):
        EncodePrefillWorker(ModelSpec(), torch.device("cpu"), compile_layers="yes")
    worker = EncodePrefillWorker(ModelSpec(), torch.device("cpu"), compile_layers=option)
    layout = KVCacheLayout.from_config(worker.model.config, num_pages=8, page_size=16)
    pool = shared_tensor.create("kv_pool", layout.shape, layout.dtype, torch.device("cpu"))
    try:
        with caplog.at_level("INFO", logger="backends.stages.encode_prefill_worker"):
            layers = worker.runner.model.model.language_model.layers
        assert [layer._compiled_call_impl is not None for layer in layers] == [compiled] * len(layers)
        assert f"TorchAttentionBackend attention, decoder layers {'compiled' if compiled else 'eager'}" in caplog.text
    finally:
        worker.shutdown()
        pool.release()


def test_a_compile_that_fails_leaves_the_layers_eager_and_says_why(monkeypatch, caplog):
    """The compile's warm-up at the runner's making fails (as inductor does without a C compiler): logged, the layers
    back to eager, and the stage's prefill runs."""
    from backends.runtime import model_runner
    from backends.runtime.model_runner import PrefillChunk

    def broken(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

    def compile_broken(language_model):
        for module in (*language_model.layers, language_model.norm):
            module._compiled_call_impl = broken

    monkeypatch.setattr(model_runner, "compile_decoder_layers", compile_broken)
    worker = EncodePrefillWorker(ModelSpec(), torch.device("cpu"), compile_layers="on")
    layout = KVCacheLayout.from_config(worker.model.config, num_pages=8, page_size=16)
    pool = shared_tensor.create("kv_pool", layout.shape, layout.dtype, torch.device("cpu"))
    try:
        with caplog.at_level("INFO", logger="backends.stages.encode_prefill_worker"):
            runner = worker.runner
        assert "compiling the decoder layers failed, they run eagerly: RuntimeError: InvalidCxxCompiler" in caplog.text
        assert "decoder layers eager" in caplog.text
        assert all(layer._compiled_call_impl is None for layer in runner.model.model.language_model.layers)
        embeds = runner.embed(torch.arange(3, 12))
        logits = runner.prefill([PrefillChunk(embeds, torch.arange(9).expand(3, -1), 0, [0], True)])
        assert logits.shape == (1, runner.model.config.get_text_config().vocab_size) and torch.isfinite(logits).all()
    finally:
        worker.shutdown()
        pool.release()


@pytest.mark.parametrize("lm_weights", ["lm_weights", None])
def test_without_decodes_weights_to_map_the_language_model_is_its_own_and_as_decode_builds_it(lm_weights):
    """With weights to share the language model waits unbuilt for decode's; none published: built at the first step,
    the values decode's build has (fused as decode fuses). Without sharing it is built at load."""
    from backends.ipc import shared_weights
    from backends.runtime.language_model.fuse import fuse_projections
    from backends.runtime.loader import load_model
    worker = EncodePrefillWorker(ModelSpec(seed=5), torch.device("cpu"), lm_weights=lm_weights)
    assert all(p.is_meta for _, p in shared_weights.lm_parameters(worker.model)) == (lm_weights is not None)
    layout = KVCacheLayout.from_config(worker.model.config, num_pages=8, page_size=16)
    pool = shared_tensor.create("kv_pool", layout.shape, layout.dtype, torch.device("cpu"))
    try:
        worker.runner
        decode_side, _ = load_model(ModelSpec(seed=5))
        fuse_projections(decode_side.model.language_model)
        expected = dict(shared_weights.lm_parameters(decode_side))
        for name, p in shared_weights.lm_parameters(worker.model):
            assert torch.equal(p, expected[name]), name
    finally:
        worker.shutdown()
        pool.release()


def test_a_language_model_that_cannot_be_made_fails_every_step_with_the_reason(monkeypatch):
    worker = EncodePrefillWorker(ModelSpec(), torch.device("cpu"))  # nothing published: the fallback runs
    layout = KVCacheLayout.from_config(worker.model.config, num_pages=8, page_size=16)
    pool = shared_tensor.create("kv_pool", layout.shape, layout.dtype, torch.device("cpu"))
    calls = []

    def no_memory():
        calls.append(1)
        raise MemoryError("out of memory")

    monkeypatch.setattr(worker, "_build_language_model", no_memory)
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match="decode's copy could not be mapped and its own could not be made "
                                                   r"\(MemoryError: out of memory\)"):
                worker.runner
        assert len(calls) == 1  # tried once, not again at every step
    finally:
        pool.release()


def test_a_checkpoint_too_large_to_read_twice_is_read_after_decode_shared_its_weights(tmp_path, monkeypatch):
    import threading
    import time
    from backends.ipc import shared_weights
    from backends.runtime.loader import load_model
    from backends.stages import encode_prefill_worker
    model, tokenizer = load_model(ModelSpec(seed=2))
    model.save_pretrained(tmp_path / "checkpoint")
    tokenizer.save_pretrained(tmp_path / "checkpoint")
    monkeypatch.setattr(encode_prefill_worker, "host_available_bytes", lambda: 1000)  # room for less than one read
    sharing, published = threading.Event(), []

    def decode_shares():
        time.sleep(0.5)
        sharing.set()  # decode's own read is let go by now (load_model kept its parts on the device)
        published.append(shared_weights.publish(model, "lm_weights", torch.device("cpu")))

    loads = []
    load = encode_prefill_worker.load_model
    monkeypatch.setattr(encode_prefill_worker, "load_model", lambda *a: loads.append(sharing.is_set()) or load(*a))
    decode = threading.Thread(target=decode_shares)
    decode.start()
    try:
        EncodePrefillWorker(ModelSpec(model_path=str(tmp_path / "checkpoint")), torch.device("cpu"))
        assert loads == [True]  # read once decode had shared
    finally:
        decode.join()
        for shared in published:
            shared.release()
