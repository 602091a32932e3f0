"""orchestrator/media.py's probe of a video file is kept for the next request about the same file, and made again
once the file is rewritten; a file gone since the request was checked, or swapped for a FIFO, is a bad input naming
it (at once: no reader blocks); the server's media defaults (the ``media_defaults`` parameter) fill what a request
leaves unset, and bad ones name the parameter."""
import json
import os
import re

import pytest

from flashcodec.families import family
from flashcodec.probe import ImageInfo
from orchestrator import media
from orchestrator.inputs import MediaInput
from orchestrator.sampling_params import InvalidInput, parse_sampling_parameters
from orchestrator.config import OrchestratorConfig
from tests.media import make_video
from tests.unit.flashcodec.test_files import NOT_REGULAR, refused_at_once, swap_for_a_fifo


def test_a_video_files_probe_is_kept_until_the_file_changes(tmp_path, monkeypatch):
    path = tmp_path / "clip.mp4"
    make_video(path, num_frames=6)
    probes = []
    monkeypatch.setattr(media, "probe_video", lambda source: probes.append(source) or f"info of {source}")
    media._probe_video_file.cache_clear()
    item = MediaInput("video", path=str(path), input="video_url")
    assert media.probe_media(item) == media.probe_media(item) == f"info of {path}"
    assert len(probes) == 1
    make_video(path, num_frames=8)  # rewritten: another size, another modification time
    os.utime(path, ns=(1, 1))
    media.probe_media(item)
    assert len(probes) == 2
    path.unlink()
    with pytest.raises(InvalidInput, match="video_url: .*cannot be read"):
        media.probe_media(item)
    media.probe_media(MediaInput("video", data=b"bytes"))  # bytes are probed every time
    assert probes[-1] == b"bytes"


def test_a_probe_that_fails_on_a_file_changed_since_its_check_says_it_changed(tmp_path):
    from flashcodec.files import file_stamp

    path = tmp_path / "clip.mp4"
    make_video(path, num_frames=6)
    media._probe_video_file.cache_clear()
    item = MediaInput("video", path=str(path), input="video_url", stamp=file_stamp(path.stat()))
    path.write_bytes(b"not a video any more")  # rewritten after the request's check
    with pytest.raises(InvalidInput, match=r"^video_url: the file changed while the request ran \(replaced or "):
        media.probe_media(item)
    unchecked = MediaInput("video", path=str(path), input="video_url")  # no stamp: the probe's own words
    with pytest.raises(InvalidInput, match=r"^video_url: not a decodable video file"):
        media.probe_media(unchecked)


def test_a_video_file_swapped_for_a_fifo_after_its_check_is_refused_at_once(tmp_path):
    path = tmp_path / "clip.mp4"
    make_video(path, num_frames=6)
    media._probe_video_file.cache_clear()
    item = MediaInput("video", path=str(path), input="video_url")
    assert media.probe_media(item).num_frames == 6
    swap_for_a_fifo(path)  # a new file: probed again, not answered from the kept probe
    message = refused_at_once(lambda: media.probe_media(item), InvalidInput, path)
    assert message == f"video_url: {NOT_REGULAR}"


def test_a_file_replaced_with_its_old_size_and_times_is_another_item(tmp_path):
    from flashcodec.sampling import ImagePlan
    from orchestrator.media_identity import media_identity

    path, plan = tmp_path / "a.bin", ImagePlan(28, 28, (1, 2, 2), 4, 1)
    path.write_bytes(b"first")
    item = MediaInput("image", path=str(path))
    before, stat = media_identity(item, plan), path.stat()
    assert media_identity(item, plan) == before
    path.write_bytes(b"other")  # same size; the modification time put back, as cp -p or tar x do
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert media_identity(item, plan) != before
    assert media_identity(MediaInput("image", data=b"other"), plan) != media_identity(item, plan)  # path, bytes


def test_media_settings_are_the_served_familys_and_each_kind_takes_its_own():
    from flashcodec.families import family
    from flashcodec.probe import ImageInfo
    from orchestrator.sampling_params import RequestParams
    from tests.unit.flashcodec.test_sampling import cfr_info

    qwen, internvl = family("qwen2_5_vl"), family("internvl3")
    video, image = cfr_info(640, 360, 300, 30.0), ImageInfo(1000, 500, "RGB", "PNG")
    items = [MediaInput("video", data=b"v"), MediaInput("image", data=b"i")]
    with pytest.raises(InvalidInput, match=r"^sampling_parameters: max_tiles does not apply to the served model "
                                           r"family qwen2_5_vl \(got 2\)$"):
        media.plan_request([], [], RequestParams(max_tiles=2), qwen, 0)  # even without media
    with pytest.raises(InvalidInput, match="max_pixels does not apply to the served model family internvl3"):
        media.plan_request([], [], RequestParams(max_pixels=200_000), internvl, 0)
    # num_frames is the video's, max_tiles the image's: neither refuses the other kind
    plans, cap = media.plan_request(items, [video, image], RequestParams(num_frames=3, max_tiles=1), internvl, 0)
    assert cap is None and [p.num_groups for p in plans] == [3, 1]
    plans, _ = media.plan_request(items, [video, image], RequestParams(fps=1.0), internvl, 0)
    assert plans[0].num_groups == 10  # fps set: int(300 / 30 * 1) frames; unset, the default 8 segments
    assert media.plan_request(items, [video, image], RequestParams(), internvl, 0)[0][0].num_groups == 8
    plans, _ = media.plan_request(items, [video, image], RequestParams(fps=1.0), qwen, 0)  # fps for Qwen's video
    assert plans[0].num_groups == 5  # 10 frames at 1 fps, two a temporal patch
    plans, _ = media.plan_request(items[:1], [video], RequestParams(num_frames=400), internvl, 0)
    assert plans[0].num_groups == 300  # more segments than frames: every frame


def test_the_servers_media_defaults_fill_what_a_request_leaves_unset():
    internvl, qwen = family("internvl3"), family("qwen2_5_vl")
    defaults = media.media_defaults('{"num_frames": 32, "max_tiles": 6}', internvl)
    assert (defaults.num_frames, defaults.max_tiles) == (32, 6)
    asked = parse_sampling_parameters('{"num_frames": 4, "temperature": 0.5}')
    merged = media.with_media_defaults(asked, defaults, internvl)
    assert (merged.num_frames, merged.max_tiles, merged.temperature) == (4, 6, 0.5)  # the request's own wins
    assert media.with_media_defaults(asked, media.media_defaults("", internvl), internvl) is asked  # none: unchanged
    assert media.media_defaults('{"fps": 1.0}', qwen).fps == 1.0


def test_a_requests_own_frame_setting_wins_over_the_servers_default_which_wins_over_the_familys():
    """InternVL3 chooses a video's frames by num_frames, else fps (Family.frame_settings): a request's fps is not
    overridden by the server's num_frames; a request's num_frames wins over its own fps, as without defaults."""
    from flashcodec.families import FAMILIES
    from tests.unit.flashcodec.test_sampling import cfr_info

    internvl, qwen = family("internvl3"), family("qwen2_5_vl")
    video = cfr_info(640, 360, 300, 30.0)  # 10 s at 30 fps

    def frames(asked: str, defaults: str, served=internvl) -> int:
        params = media.with_media_defaults(parse_sampling_parameters(asked), media.media_defaults(defaults, served),
                                           served)
        return media.plan_request([MediaInput("video", data=b"v")], [video], params, served, 0)[0][0].num_groups

    assert frames("", "") == 8  # the family's default segments
    assert frames("", '{"num_frames": 32}') == frames("", '{"fps": 3.2}') == 32  # the server's default
    assert frames('{"fps": 1.0}', '{"num_frames": 32}') == 10  # the request's fps: int(300 / 30 * 1)
    assert frames('{"num_frames": 4}', '{"fps": 1.0}') == 4
    assert frames('{"num_frames": 4, "fps": 1.0}', '{"num_frames": 32}') == 4  # a request's num_frames over its fps
    assert frames("", '{"num_frames": 5, "fps": 1.0}') == 5  # and a default's over its own
    merged = media.with_media_defaults(parse_sampling_parameters('{"fps": 1.0}'),
                                       media.media_defaults('{"num_frames": 32, "max_tiles": 6}', internvl), internvl)
    assert (merged.fps, merged.num_frames, merged.max_tiles) == (1.0, None, 6)  # max_tiles: another setting
    assert frames('{"fps": 1.0}', '{"fps": 0.5}', qwen) == 5 and frames("", '{"fps": 0.5}', qwen) == 2  # 2 a group
    with pytest.raises(InvalidInput, match="num_frames does not apply to the served model family qwen2_5_vl"):
        frames('{"num_frames": 4}', '{"fps": 0.5}', qwen)  # refused, not overridden by the server's fps
    for served in FAMILIES.values():  # each lists the settings its plan_video reads for the frames, first the winner
        assert set(served.frame_settings) <= set(served.options)
    assert internvl.frame_settings == ("num_frames", "fps") and qwen.frame_settings == ("fps",)
    for served in FAMILIES.values():
        assert set(served.size_settings) <= set(served.options)


def test_a_requests_pixel_bound_takes_neither_bound_from_the_servers_defaults():
    """max_pixels and min_pixels are one setting, an item's size (as fps and num_frames are a video's frames): a
    request's max_pixels under the server's min_pixels is the request's alone, not refused as min > max."""
    qwen = family("qwen2_5_vl")
    defaults = media.media_defaults('{"min_pixels": 50000, "max_pixels": 400000}', qwen)
    merged = media.with_media_defaults(parse_sampling_parameters('{"max_pixels": 20000}'), defaults, qwen)
    assert (merged.max_pixels, merged.min_pixels) == (20000, None)
    image = ImageInfo(640, 480, "RGB", "PNG")
    assert qwen.plan_image(image, merged.media).resized_height * qwen.plan_image(image, merged.media).resized_width \
        <= 20000
    untouched = media.with_media_defaults(parse_sampling_parameters('{"fps": 1.0}'), defaults, qwen)
    assert (untouched.max_pixels, untouched.min_pixels, untouched.fps) == (400000, 50000, 1.0)


def test_media_defaults_take_vllms_internvl_name_max_dynamic_patch_as_requests_do():
    internvl = family("internvl3")
    assert media.media_defaults('{"max_dynamic_patch": 6}', internvl).max_tiles == 6
    assert media.media_defaults('{"max_tiles": 6, "max_dynamic_patch": 6}', internvl).max_tiles == 6
    with pytest.raises(ValueError, match=r"^parameter media_defaults: max_tiles 2 and max_dynamic_patch 6 are one "):
        media.media_defaults('{"max_tiles": 2, "max_dynamic_patch": 6}', internvl)
    with pytest.raises(ValueError, match="^parameter media_defaults: max_tiles does not apply to the served model "
                                         "family qwen2_5_vl"):
        media.media_defaults('{"max_dynamic_patch": 6}', family("qwen2_5_vl"))


@pytest.mark.parametrize("text, message", [
    ('{"num_frames": 32}', "parameter media_defaults: num_frames does not apply to the served model family qwen2_5_vl"),
    # the media keys alone, not sampling's
    ('{"temperature": 0.5}', "parameter media_defaults: unknown key 'temperature' (known: fps, max_pixels, "
                             "min_pixels, num_frames, max_tiles, min_tiles, dynamic_image_size, max_dynamic_patch, "
                             "min_dynamic_patch, max_patches, min_patches, crop_to_patches)"),
    ('{"fsp": 1}', "parameter media_defaults: unknown key 'fsp' (known: fps, max_pixels, min_pixels, num_frames, "
                   "max_tiles, min_tiles, dynamic_image_size, max_dynamic_patch, min_dynamic_patch, max_patches, "
                   "min_patches, crop_to_patches)"),
    ('{"fps": 0}', "parameter media_defaults: fps must be"),
    # settings no image or video can be planned with: every media request would be refused, blaming its client
    ('{"min_pixels": 200000, "max_pixels": 100000}', "parameter media_defaults: min_pixels (200000) must be > 0 and "
                                                     "<= max_pixels (100000)"),
    ('{"max_pixels": 50000}', "parameter media_defaults: max_pixels must be at least 100352 for a video"),
    ("[1]", "parameter media_defaults: must be a JSON object"),
])
def test_bad_media_defaults_stop_the_server_naming_the_parameter(text, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        media.media_defaults(text, family("qwen2_5_vl"))


def test_internvls_tile_settings_from_the_servers_defaults_and_the_request():
    """min_tiles and max_tiles are one setting, an image's grid (as max_pixels and min_pixels are an item's size): a
    request that sets either takes neither from the server; dynamic_image_size is a setting of its own, false winning
    over any tiles (vLLM's rule); a default min_tiles above the checkpoint's 12 tiles stops the server naming both."""
    internvl = family("internvl3")
    wide = ImageInfo(2000, 1000, "RGB", "PNG")  # 2:1, a 4 x 2 grid and a thumbnail by default

    def tiles(asked: str, defaults: str) -> int:
        params = media.with_media_defaults(parse_sampling_parameters(asked), media.media_defaults(defaults, internvl),
                                           internvl)
        return media.plan_request([MediaInput("image", data=b"i")], [wide], params, internvl, 0)[0][0].num_groups

    assert tiles("", "") == 9 and tiles("", '{"max_patches": 2}') == 3 and tiles("", '{"min_tiles": 9}') == 11  # 5 x 2
    assert tiles('{"max_tiles": 4}', '{"min_tiles": 9}') == 3  # 2 x 1: the server's min_tiles is not the request's
    assert tiles('{"min_patches": 9}', '{"max_tiles": 2}') == 11  # nor its max_tiles: 5 x 2, within the checkpoint's
    assert tiles('{"min_tiles": 4, "max_tiles": 16}', '{"dynamic_image_size": false}') == 1  # false wins
    assert tiles('{"crop_to_patches": true}', '{"dynamic_image_size": false, "max_tiles": 2}') == 3
    with pytest.raises(InvalidInput, match=r"^sampling_parameters: min_tiles 13 and max_tiles 12 \(the checkpoint's\): "
                                           r"need 1 <= min_tiles <= max_tiles$"):
        tiles('{"min_tiles": 13}', "")
    with pytest.raises(InvalidInput, match=r"^sampling_parameters: min_tiles 6 and max_tiles 5: need"):
        tiles('{"min_dynamic_patch": 6, "max_patches": 5}', "")
    with pytest.raises(ValueError, match=r"^parameter media_defaults: min_tiles 13 and max_tiles 12 \(the "):
        media.media_defaults('{"min_patches": 13}', internvl)
    for key in ("min_tiles", "dynamic_image_size"):  # InternVL3's, refused by Qwen2.5-VL naming them
        with pytest.raises(InvalidInput, match=rf"^sampling_parameters: {key} does not apply to the served model "
                                               r"family qwen2_5_vl"):
            media.check_media_settings(parse_sampling_parameters(json.dumps({key: 2 if key == "min_tiles" else True})),
                                       family("qwen2_5_vl"))


def test_the_orchestrator_config_reads_media_defaults():
    config = OrchestratorConfig.from_parameters({"preset": "internvl3_tiny", "media_defaults": '{"num_frames": 16}'})
    assert config.model.family.name == "internvl3" and config.media_defaults.num_frames == 16
    with pytest.raises(ValueError, match="parameter media_defaults"):
        OrchestratorConfig.from_parameters({"media_defaults": '{"num_frames": 16}'})  # tiny: a Qwen2.5-VL preset


def test_the_launchers_set_gives_media_defaults_vllms_name_too():
    from backends.triton.repository import parse_overrides

    params = parse_overrides(['orchestrator.media_defaults={"max_dynamic_patch": 6}', "*.preset=internvl3_tiny"])
    assert OrchestratorConfig.from_parameters(params["orchestrator"]).media_defaults.max_tiles == 6
