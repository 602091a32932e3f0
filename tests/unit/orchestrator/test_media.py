"""orchestrator/media.py's probe of a video file is kept for the next request about the same file, and made again
once the file is rewritten; a file gone since the request was checked is a bad input naming it."""
import os

import pytest

from orchestrator import media
from orchestrator.inputs import MediaInput
from orchestrator.sampling_params import InvalidInput
from tests.media import make_video


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
