"""The peer benchmark's models (bench/peer/models.py): each system's command line per model (bench/peer/servers.py),
the video kwargs every request holding a video carries to both systems (bench/peer/load.py), a scenarios call
refused against a server of another model, and the version recorded for UnifiedServe (bench/peer/run.py)."""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from bench.peer import run, servers
from bench.peer.load import ChatRequest, Target, chat_parts
from bench.peer.models import DEFAULT, INTERNVL_FRAMES, MODELS


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_default_model_keeps_the_qwen_commands():
    ours, _ = servers.command("unifiedserve", Path("ckpt"), Path("media"), False, [])
    sets = [ours[k + 1] for k, a in enumerate(ours) if a == "--set"]
    assert sets[:5] == ["*.load_format=dummy", "*.preset=qwen2_5_vl_7b", "*.dtype=bfloat16", "decode.kv_pages=16384",
                        "orchestrator.max_model_len=128000"]
    theirs, _ = servers.command("vllm", Path("ckpt"), Path("media"), False, [])
    assert (_value(theirs, "--max-model-len"), _value(theirs, "--max-num-batched-tokens")) == ("128000", "110000")
    assert json.loads(_value(theirs, "--mm-processor-kwargs")) == {"do_sample_frames": False}
    assert "--media-io-kwargs" not in theirs and MODELS[DEFAULT].video_kwargs == {}


@pytest.mark.parametrize("gpu_gib, flag", [(79.6, True), (139.8, False), (None, False)])
def test_vllm_takes_less_gpu_memory_on_a_smaller_card(gpu_gib, flag):
    theirs, _ = servers.command("vllm", Path("ckpt"), Path("media"), False, ["--x"], gpu_gib=gpu_gib)
    assert ("--gpu-memory-utilization" in theirs) is flag
    if flag:  # before the caller's own arguments, which may set it again (argparse keeps the last)
        assert theirs[-3:] == [*servers.SMALL_GPU_VLLM, "--x"] and servers.SMALL_GPU_VLLM[1] == "0.7"
    ours, _ = servers.command("unifiedserve", Path("ckpt"), Path("media"), False, [], gpu_gib=gpu_gib)
    assert "--gpu-memory-utilization" not in ours


@pytest.mark.parametrize("name, pages, fewer_sms", [
    ("internvl3_38b", "8192", ["encode_prefill.sms_while_decoding=72", "orchestrator.fewer_sms_kinds=video,image"]),
    ("internvl3_8b", "16384", ["encode_prefill.sms_while_decoding=104"]),  # the 7B-sized language model: Qwen's file
])
def test_internvl3_commands(name, pages, fewer_sms):
    """Each model is served with its own H200 deployment file's scheduling settings (``PeerModel.deploy``)."""
    model = MODELS[name]
    ours, env = servers.command("unifiedserve", Path("/w/ckpt"), Path("/w/media"), False, ["--x"], model=model)
    sets = [ours[k + 1] for k, a in enumerate(ours) if a == "--set"]
    assert sets == ["*.load_format=dummy", f"*.preset={name}", "*.dtype=bfloat16", f"decode.kv_pages={pages}",
                    "orchestrator.max_model_len=32768", *fewer_sms,
                    "orchestrator.burst_wait_ms=20", "orchestrator.decode_pace_ms=40",
                    "orchestrator.idle_budget_scale=4", "orchestrator.slo_text_tbt_ms=15",
                    "orchestrator.prefix_caching=false",
                    "orchestrator.encoder_cache_tokens=0"]
    assert not any(s.split("=")[0].endswith("_budget") for s in sets)  # InternVL3's own: encode 5120, prefill 2048
    assert _value(ours, "--model") == "/w/ckpt" and ours[-1] == "--x" and env["UNIFIEDSERVE_MEDIA_DIRS"] == "/w/media"
    theirs, _ = servers.command("vllm", Path("/w/ckpt"), Path("/w/media"), False, [], model=model)
    assert (_value(theirs, "--model"), _value(theirs, "--max-model-len"),
            _value(theirs, "--max-num-batched-tokens")) == ("/w/ckpt", "32768", "8192")
    assert json.loads(_value(theirs, "--media-io-kwargs")) == {"video": {"num_frames": INTERNVL_FRAMES}}
    assert json.loads(_value(theirs, "--limit-mm-per-prompt")) == {"image": 2, "video": 1}
    assert "--mm-processor-kwargs" not in theirs  # InternVLVideoProcessor samples nothing by default
    assert model.video_kwargs == {"num_frames": INTERNVL_FRAMES} and model.checkpoint_dir == f"{name}_dummy"


def test_requests_holding_a_video_carry_the_models_video_kwargs():
    kwargs = MODELS["internvl3_38b"].video_kwargs
    video = ChatRequest("video", chat_parts("Q", videos=["file:///v.mp4"]), 8)
    text = ChatRequest("text", chat_parts("Q"), 8)
    chat = ChatRequest("followup_chat", chat_parts("Again?"), 8,
                       history=({"role": "user", "content": list(video.parts)}, {"role": "assistant", "content": "A"}))
    assert video.body("m", video_kwargs=kwargs)["mm_processor_kwargs"] == {"num_frames": INTERNVL_FRAMES}
    assert chat.body("m", video_kwargs=kwargs)["mm_processor_kwargs"] == {"num_frames": INTERNVL_FRAMES}
    assert "mm_processor_kwargs" not in text.body("m", video_kwargs=kwargs)
    assert "mm_processor_kwargs" not in video.body("m")  # Qwen2.5-VL's requests are as before


def test_scenarios_refuse_a_server_of_another_model():
    state = {"url": "http://127.0.0.1:1", "model": "/w/internvl3_38b_dummy", "peer_model": "internvl3_38b"}
    args = argparse.Namespace(model="internvl3_38b", no_timelines=False)
    assert run.target_of(args, "vllm", state) == Target("vllm", state["url"], state["model"],
                                                        {"num_frames": INTERNVL_FRAMES})
    with pytest.raises(SystemExit, match="--model internvl3_38b"):
        run.target_of(argparse.Namespace(model=DEFAULT, no_timelines=False), "vllm", state)
    with pytest.raises(SystemExit, match=f"--model {DEFAULT}"):  # a server started before --model
        run.target_of(args, "unifiedserve", {k: v for k, v in state.items() if k != "peer_model"})


def test_only_unifiedserve_is_asked_for_timelines_and_not_with_no_timelines():
    state = {"url": "http://127.0.0.1:1", "model": "m", "peer_model": DEFAULT}
    request = ChatRequest("text", ({"type": "text", "text": "hi"},), 4)
    for system, no_timelines, asked in (("unifiedserve", False, True), ("unifiedserve", True, False),
                                        ("vllm", False, False)):
        target = run.target_of(argparse.Namespace(model=DEFAULT, no_timelines=no_timelines), system, state)
        assert target.timeline is asked
        assert ("return_timeline" in request.body("m", target.timeline)) is asked


def test_unifiedserve_version_is_the_commit_and_says_when_the_tree_differs_from_it(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f.py").write_text("a = 1\n")
    subprocess.run([*git, "add", "f.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    (tmp_path / "new.txt").write_text("untracked\n")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "r.json").write_text("{}\n")
    subprocess.run([*git, "add", "bench"], check=True)
    subprocess.run([*git, "commit", "-qm", "results"], check=True)
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "bench" / "results" / "r.json").write_text('{"new": 1}\n')  # results unpacked: no server change
    assert run.server_version("unifiedserve", "", repo=tmp_path) == commit
    (tmp_path / "f.py").write_text("a = 2\n")
    assert run.server_version("unifiedserve", "", repo=tmp_path) == commit + "+modified"
    assert run.server_version("unifiedserve", "", repo=tmp_path / "nowhere") is None


def test_passes_repeat_the_fixed_scenarios_only():
    """``--passes 3``: a fixed scenario three times (its median figures: ``summary.median_figures``); a goodput rate,
    the cross-check and the cache scenarios once (a second pass would find its media cached or another load)."""
    args = argparse.Namespace(passes=3)
    assert list(run.passes(args, "text_c32")) == [1, 2, 3] and list(run.passes(args, "mixed_video")) == [1, 2, 3]
    for name in ("goodput_video@0.04", "goodput_images@unloaded", "crosscheck", "followup", "multiturn"):
        assert list(run.passes(args, name)) == [1]


def test_a_new_first_pass_drops_the_scenarios_later_passes(tmp_path):
    for stem in ("text_c32", "text_c32.pass2", "text_c32.pass3", "text_c1.pass2", "goodput_video_at_0.04"):
        (tmp_path / f"{stem}.json").write_text("{}")
    run.drop_later_passes(tmp_path, "text_c32")
    assert sorted(p.stem for p in tmp_path.iterdir()) == ["goodput_video_at_0.04", "text_c1.pass2", "text_c32"]


def test_passes_below_one_are_refused(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["run.py", "scenarios", "--passes", "0"])
    with pytest.raises(SystemExit):
        run.main()
    assert "--passes must be at least 1, got 0" in capsys.readouterr().err


def test_stop_keeps_the_logs_the_launcher_names(tmp_path):
    """The launcher's own lines name tritonserver's log and the OpenAI API's: their tails are copied beside the
    system's log (a stage's garbage-collection warning is only there); a named file that has gone is skipped."""
    server_log, api_log = tmp_path / "unifiedserve-run-x.log", tmp_path / "unifiedserve-run-x.openai.log"
    server_log.write_bytes(b"A" * servers.KEPT_LOG_BYTES + b"decode: a generation-2 garbage collection paused\n")
    api_log.write_text("api started\n")
    own = tmp_path / "logs" / "unifiedserve.log"
    own.parent.mkdir()
    own.write_text(f"tritonserver starting, log: {server_log}\n"
                   f"tritonserver ready: gRPC 127.0.0.1:1, HTTP 127.0.0.1:2, log {server_log}, models /tmp/repo\n"
                   f"OpenAI-compatible API: http://127.0.0.1:9000/v1, log {api_log}\n"
                   f"a line naming a log that has gone: log: {tmp_path / 'gone.log'}\n")
    kept = servers.keep_named_logs(own)
    assert kept == [own.parent / f"unifiedserve.{server_log.name}", own.parent / f"unifiedserve.{api_log.name}"]
    assert len(kept[0].read_bytes()) == servers.KEPT_LOG_BYTES
    assert kept[0].read_bytes().endswith(b"garbage collection paused\n")
    assert kept[1].read_text() == "api started\n"
    assert servers.keep_named_logs(tmp_path / "no.log") == []
