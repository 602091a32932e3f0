"""Which steps run on fewer SMs (``orchestrator/fewer_sms.py``): a video's steps, its last included, with no image
work, beside a stream whose TBT target is tighter than 50 ms; the engine sending such steps marked (fake
stages: ``fake_stages.py``)."""
from __future__ import annotations

import pytest

from backends.ipc.protocol import EncodeWork, PrefillWork, StepPlan
from orchestrator.budget_policy import SloTargets
from orchestrator.fewer_sms import FewerSms, kinds_parameter
from tests.unit.orchestrator.test_engine import World, outputs_of, run, settle

RULE = FewerSms(SloTargets(tbt_ms={"text": 15.0}))  # image, video: the default 50-ms target


def plan(*works: tuple[int, bool], encode: tuple[int, ...] = ()) -> StepPlan:
    """A step prefilling ``(tokens, ends its prompt)`` for requests r0, r1, ... and encoding a group of each
    request index in ``encode``."""
    return StepPlan((), tuple(EncodeWork(f"r{i}", 0, 0, (0,), 64, 0) for i in encode),
                    tuple(PrefillWork(f"r{i}", 0, tokens, (), last) for i, (tokens, last) in enumerate(works)))


def kinds(*names: str):
    """``kind_of`` for requests r0, r1, ... of these modalities."""
    return {f"r{i}": name for i, name in enumerate(names)}.get


@pytest.mark.parametrize("step, decoding, kind_of, fewer", [
    (plan((2048, False)), ["text"], kinds("video"), True),                # a video's middle chunk beside a text stream
    (plan(encode=(0,)), ["text"], kinds("video"), True),                  # its encode alone
    (plan((2000, False), (48, True)), ["text"], kinds("video", "text"), True),  # a text prompt ending beside it
    (plan((2048, True)), ["text"], kinds("video"), True),                 # the chunk that ends the video's prompt
    (plan((2048, False)), [], kinds("video"), False),                     # nothing decoding
    (plan((2048, False)), ["video", "image"], kinds("video"), False),     # streams with the default 50-ms target
    (plan((2048, False)), ["video", "text"], kinds("video"), True),       # the tightest target decides
    (plan((1024, False), (1024, False)), ["text"], kinds("video", "image"), False),  # an image's work beside it
    (plan((2048, False), encode=(1,)), ["text"], kinds("video", "image"), False),    # an image's encode
    (plan((117, True)), ["text"], kinds("text"), False),                  # text prompts only
    (plan((2048, False)), ["text"], kinds(), False),                      # its request has gone
])
def test_which_steps_run_on_fewer_sms(step, decoding, kind_of, fewer):
    assert RULE(step, decoding, kind_of) is fewer


def test_decode_priority_boost_makes_a_default_target_tight():
    assert FewerSms(SloTargets(), boost=2.0)(plan((2048, False)), ["video"], kinds("video"))
    assert not FewerSms(SloTargets())(plan((2048, False)), ["video"], kinds("video"))


@pytest.mark.parametrize("kind, marked", [("video", [True, True, True]), ("image", [False, False, False])])
def test_a_videos_steps_beside_a_tight_stream_go_to_the_stage_on_fewer_sms(kind, marked):
    """While text "a" (15-ms TBT target) decodes, a video's steps are sent marked ``fewer_sms``
    (``orchestrator/fewer_sms.py``), its last too; an image's never. The scheduler completes the plans it made."""
    async def body(w: World):
        out = w.text("a", prompt_len=8, max_tokens=2)
        await outputs_of(out, 1)
        video = w.image("v", kind=kind, max_tokens=1)
        await settle()
        w.media.ready("v", 0, 0, 1)
        w.media.finish("v", 0)
        await outputs_of(video, 1)
        assert [p.fewer_sms for p in w.stages.plans] == [False, *marked]
        w.stages.emit(("a", 8, "length"))
        await outputs_of(out, 1)
    run(body, prefill_budget=8, fewer_sms=FewerSms(SloTargets(tbt_ms={"text": 15.0})))


IMAGES_TOO = FewerSms(SloTargets(tbt_ms={"text": 15.0}), kinds=frozenset({"video", "image"}))


@pytest.mark.parametrize("step, kind_of, fewer", [
    (plan((1024, False), (1024, False)), kinds("video", "image"), True),  # both modalities' work
    (plan((1280, True)), kinds("image"), True),                           # an image's prompt ending
    (plan(encode=(0,)), kinds("image"), True),                            # its encode alone
    (plan((117, True)), kinds("text"), False),                            # text prompts only
])
def test_fewer_sms_kinds_video_image_puts_an_images_steps_on_fewer_sms(step, kind_of, fewer):
    assert IMAGES_TOO(step, ["text"], kind_of) is fewer


@pytest.mark.parametrize("value, kinds_", [("", {"video"}), ("video", {"video"}), ("video,image", {"video", "image"}),
                                           ("image", {"image"}), ("video,text", {"video", "text"}),
                                           ("video,image,text", {"video", "image", "text"})])
def test_the_fewer_sms_kinds_parameter(value, kinds_):
    assert kinds_parameter({"fewer_sms_kinds": value}) == kinds_
    assert kinds_parameter({}) == {"video"}


@pytest.mark.parametrize("value", ["text", "video,", "videos", "video;image", "video, image"])
def test_a_fewer_sms_kinds_parameter_that_is_not_one_of_its_choices_is_refused(value):
    with pytest.raises(ValueError, match="parameter fewer_sms_kinds must be video, image, video,image, video,text or "
                                         "video,image,text, got"):
        kinds_parameter({"fewer_sms_kinds": value})


def test_the_orchestrator_reads_fewer_sms_kinds_and_names_a_bad_one():
    from orchestrator.config import OrchestratorConfig

    assert OrchestratorConfig.from_parameters({}).fewer_sms_kinds == {"video"}
    assert OrchestratorConfig.from_parameters({"fewer_sms_kinds": "video,image"}).fewer_sms_kinds == {"video", "image"}
    with pytest.raises(ValueError, match="fewer_sms_kinds"):
        OrchestratorConfig.from_parameters({"fewer_sms_kinds": "audio"})


TEXT_TOO = FewerSms(SloTargets(tbt_ms={"text": 15.0}), kinds=frozenset({"video", "text"}))


@pytest.mark.parametrize("step, decoding, kind_of, fewer", [
    (plan(*[(117, True)] * 14), ["text"] * 18, kinds(*["text"] * 14), True),   # a burst's last step beside its first
    (plan(*[(117, True)] * 18), ["text"] * 18, kinds(*["text"] * 18), True),   # as many prompts ending as streams
    (plan(*[(117, True)] * 17), ["text"], kinds(*["text"] * 17), False),       # more: the pacer's step, whole GPU
    (plan((2048, False)), ["text"], kinds("text"), True),                      # a long text prompt's middle chunk
    (plan((117, True)), [], kinds("text"), False),                             # nothing decoding
    (plan((117, True)), ["video"], kinds("text"), False),                      # a stream with the 50-ms target
    (plan((1280, True)), ["text"], kinds("image"), False),                     # an image's work: not a kind here
    (plan((1000, True), (1048, False)), ["text"], kinds("text", "video"), True),  # beside a video's chunk
    (StepPlan((), (), ()), ["text"], kinds(), False),                                  # no work at all
])
def test_fewer_sms_kinds_with_text_puts_a_text_step_that_favours_decode_on_fewer_sms(step, decoding, kind_of, fewer):
    assert TEXT_TOO(step, decoding, kind_of) is fewer


def test_fewer_sms_kinds_image_alone_leaves_a_videos_steps_on_the_whole_gpu():
    images_only = FewerSms(SloTargets(tbt_ms={"text": 15.0}), kinds=frozenset({"image"}))
    assert images_only(plan((1280, True)), ["text"], kinds("image"))
    assert not images_only(plan((2048, False)), ["text"], kinds("video"))
