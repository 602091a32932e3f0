"""What the launcher prints while the models load (backends/triton/load_progress.py), from Triton's lines
(server_log.load_event) and the stages' tagged log lines (model_log)."""
import io
import logging
import threading

import pytest

from backends.triton import model_log
from backends.triton.load_progress import LoadProgress
from backends.triton.server_log import DEAD_STUB_HINT, load_errors, load_event, not_unloaded, still_loading

# Lines as tritonserver 2.51 writes them (copied from a server log of this project)
LOADING = 'I1201 15:29:48.334359 10823 model_lifecycle.cc:472] "loading: decode:1"'
LOADED = 'I1201 15:29:57.771033 10823 model_lifecycle.cc:839] "successfully loaded \'decode\'"'
FAILED = ('E1201 15:29:57.771033 10823 model_lifecycle.cc:642] "failed to load \'decode\' version 1: Internal: '
          'ValueError: dtype must be one of (\'auto\', \'float32\')\\nAt:\\n  /x/loader.py(45): __post_init__\\n"')
UNLOADED = 'I1201 15:30:10.972567 10823 model_lifecycle.cc:624] "successfully unloaded \'decode\' version 1"'


def test_triton_load_lines():
    assert load_event(LOADING) == ("decode", "loading", "")
    assert load_event(LOADED) == ("decode", "loaded", "")
    assert load_event(FAILED) == ("decode", "failed", "ValueError: dtype must be one of ('auto', 'float32')")
    assert load_event(UNLOADED) is None
    assert load_event("unifiedserve[decode] INFO loading: decode:1") is None


def test_a_model_whose_load_never_ended_is_named():
    """A start that timed out with encode_prefill's load begun but never ended (a fresh user's `make test`, once)."""
    log = "\n".join([LOADING, LOADING.replace("decode", "encode_prefill"), LOADING.replace("decode", "flashcodec"),
                     LOADED, FAILED.replace("decode", "flashcodec")])
    assert still_loading(log) == ["encode_prefill"]  # decode loaded, flashcodec failed (load_errors names it)
    assert still_loading(LOADING + "\n" + LOADED) == [] and still_loading("") == []


@pytest.fixture
def our_loggers():
    """model_log.install changes process-wide logging: put our packages' loggers back afterwards."""
    saved = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).level,
                    logging.getLogger(name).propagate) for name in model_log.PACKAGES}
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate


def test_stage_lines_are_tagged_with_the_model_and_parsed_back(our_loggers):
    out = io.StringIO()
    model_log.install("decode_r1", out)
    model_log.install("decode_r1", out)  # once per process: a second call does not double the lines
    logging.getLogger("backends.stages.decode_worker").info("capturing CUDA graphs for batch sizes up to %d", 256)
    logging.getLogger("flashcodec.pipeline").warning("NVDEC unavailable")
    logging.getLogger("torch._inductor").info("not ours: stays quiet")
    lines = out.getvalue().splitlines()
    assert lines == ["unifiedserve[decode_r1] INFO capturing CUDA graphs for batch sizes up to 256",
                     "unifiedserve[decode_r1] WARNING NVDEC unavailable"]
    assert model_log.parse(lines[0]) == ("decode_r1", "INFO", "capturing CUDA graphs for batch sizes up to 256")
    assert model_log.parse(LOADING) is None


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_loading_slow_steps_warnings_and_the_end_of_each_load():
    said, clock = [], Clock()
    progress = LoadProgress(said.append, slow_s=5, repeat_s=30, clock=clock)
    progress.line(LOADING)
    progress.line('I1201 15:29:48.334296 10823 model_lifecycle.cc:472] "loading: orchestrator:1"')
    progress.line("unifiedserve[decode] INFO building preset tiny with random weights on cuda:0")
    clock.now += 2
    progress.line("unifiedserve[decode] INFO capturing CUDA graphs for batch sizes up to 256")
    clock.now += 2
    progress.tick()  # nothing has lasted 5 s yet (decode's first step was replaced before it did)
    assert said == ["decode: loading", "orchestrator: loading"]
    clock.now += 3
    progress.tick()
    progress.tick()  # said once, not at every tick
    clock.now += 30
    progress.tick()  # and again after repeat_s
    progress.line("unifiedserve[decode] WARNING load_format=dummy: random weights")
    progress.line('I1201 15:29:57.810502 10823 model_lifecycle.cc:839] "successfully loaded \'orchestrator\'"')
    progress.line(FAILED)
    progress.line("unifiedserve[decode] INFO a line after its load: not shown")
    progress.tick()
    assert said[2:] == [
        "decode: capturing CUDA graphs for batch sizes up to 256 (5 s)",  # orchestrator, silent, waits for repeat_s
        "decode: capturing CUDA graphs for batch sizes up to 256 (35 s)",
        "orchestrator: still loading (37 s)",
        "decode: warning: load_format=dummy: random weights",
        "orchestrator: loaded in 37.0 s",
        "decode: failed to load: ValueError: dtype must be one of ('auto', 'float32')",
    ]


def test_follow_reads_the_log_as_it_grows_and_everything_before_stop(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("")
    said, seen = [], threading.Event()

    def say(text: str) -> None:
        said.append(text)
        if text == "decode: loading":
            seen.set()

    progress = LoadProgress(say)
    progress.follow(log, period_s=0.01)
    with open(log, "a") as f:
        f.write(LOADING + "\n" + LOADED[:30])  # a line cut in the middle of its write
        f.flush()
        assert seen.wait(10)
        f.write(LOADED[30:] + "\n")
    progress.stop()
    assert said[0] == f"tritonserver starting, log: {log}"
    assert said[1] == "decode: loading" and said[2].startswith("decode: loaded in ")


def test_a_stub_that_died_while_loading_is_said_to_have_died():
    log = ("E1204 failed to load 'decode' version 1: Internal: Stub process 'decode_0_0' is not healthy.\n"
           "E1204 failed to load 'orchestrator' version 1: Internal: ValueError: bad max_share\\nAt:\n")
    assert load_errors(log) == [
        f"model decode did not load: Stub process 'decode_0_0' is not healthy. ({DEAD_STUB_HINT})",
        "model orchestrator did not load: ValueError: bad max_share"]


def test_a_stop_held_by_http_connections_is_named_not_the_models():
    """Triton 2.51 waits for HTTP connections before it unloads anything: where its log shows that wait running out
    (a keep-alive client), the launcher says so instead of blaming the models (a fresh operator's find)."""
    held = ('I1206 http_server.cc:248] "Timeout 2: Found 1 HTTP service connections"\n'
            'I1206 http_server.cc:248] "Timeout 1: Found 1 HTTP service connections"\n'
            'I1206 server.cc:336] "All models are stopped, unloading models"\n'
            'E1206 main.cc:535] "failed to stop server: Internal - Exit timeout expired. Exiting immediately."\n')
    assert not_unloaded(held, ["decode"]).startswith("an HTTP client kept its connection open")
    assert not_unloaded("successfully unloaded 'decode'", ["decode", "orchestrator"]) == \
        "model orchestrator had not unloaded"
