"""Media files opened by path (flashcodec/files.py): a regular file reads as usual; a FIFO, a folder or a device is
refused at once, also where a path checked as a regular file was swapped for a FIFO before it was read (a reader
used to block for ever: a fresh user's break test), and the image probe refuses it the same way."""
import os
import threading

import pytest

from flashcodec.errors import MediaError
from flashcodec.files import open_regular, read_regular
from flashcodec.probe import probe_image
from tests.media import make_image


def _refused_at_once(call) -> str:
    """The MediaError message of ``call()``, which must return within 5 s (a blocked reader fails the test)."""
    outcome = {}

    def run():
        try:
            call()
        except MediaError as exc:
            outcome["message"] = str(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "the reader blocked"
    return outcome["message"]


def test_a_regular_file_reads_whole_and_blocks_as_usual(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"abc" * 1000)
    assert read_regular(path, "image") == b"abc" * 1000
    with open_regular(str(path), "video") as f:
        assert f.read(3) == b"abc" and os.get_blocking(f.fileno())  # O_NONBLOCK cleared


@pytest.mark.parametrize("kind", ["fifo", "folder", "device", "missing"])
def test_what_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    path = tmp_path / "x.jpg"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "device":
        path = "/dev/zero"
    message = _refused_at_once(lambda: read_regular(path, "image"))
    if kind == "missing":
        assert message == "image: the file cannot be read (No such file or directory)"
    else:
        assert message == "image: not a regular file (a folder, device or pipe)"


def test_the_image_probe_refuses_a_path_swapped_for_a_fifo(tmp_path):
    path, fifo = tmp_path / "race.jpg", tmp_path / "fifo"
    path.write_bytes(make_image(64, 48, "RGB", "JPEG"))
    assert (probe_image(str(path)).width, probe_image(path).height) == (64, 48)
    os.mkfifo(fifo)
    os.replace(fifo, path)  # after the request's check, before the probe
    assert _refused_at_once(lambda: probe_image(str(path))) == "image: not a regular file (a folder, device or pipe)"
