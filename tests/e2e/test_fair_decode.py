"""Issue 18: a request of many large images cannot hold another request's small image back behind all of them;
flashcodec's decode threads are shared between requests (flashcodec/fair_queue.py).

The property is an order, watched from outside the server: which files are opened when (inotify). Each item named
by ``image_url`` is opened twice, once by the orchestrator's header probe and once by the flashcodec thread that
decodes it. Times to first token on a shared 2-core machine vary by seconds from run to run, so the times are in the
failure message only; bench/fair_decode.py measures them."""
from __future__ import annotations

import time

import pytest

from backends.triton.repository import model_parameters
from bench.fair_decode import small_beside_big, write_noise_png
from tests.e2e.file_opens import FileOpens
from tests.media import make_image

pytestmark = pytest.mark.e2e

IMAGES = 24  # the big request's items: hard links to one 3000x3000 noise PNG (25 MB, about 0.2 s to decode alone)


def test_a_small_image_waits_for_a_free_thread_not_for_a_big_request(server, grpc_url, media_dir):
    threads = int(model_parameters()["flashcodec"]["decode_threads"])
    folder = media_dir / "fair_decode"
    folder.mkdir()
    noise = write_noise_png(folder / "noise.png", 3000)
    big = [folder / f"big{i}.png" for i in range(IMAGES)]
    for path in big:
        path.hardlink_to(noise)
    small = folder / "small.png"
    small.write_bytes(make_image(64, 64, "RGB", "PNG"))
    with FileOpens(folder) as opens:
        def every_thread_busy() -> None:
            """Until the big request's items are all probed and its decodes hold every thread (a lone request
            uses them all)."""
            deadline = time.monotonic() + 120
            while sum(name.startswith("big") for _, name in opens.events()) < IMAGES + threads:
                assert time.monotonic() < deadline, f"flashcodec did not start {threads} decodes: {opens.events()}"
                time.sleep(0.01)

        small_s, big_s = small_beside_big(grpc_url, small, big, every_thread_busy)
        names = [name for _, name in opens.events()]
    assert all(names.count(path.name) == 2 for path in big) and names.count("small.png") == 2, names
    probed, decoded = [i for i, name in enumerate(names) if name == "small.png"]
    meanwhile = sum(name.startswith("big") for name in names[probed:decoded])
    # First come, first served, the small image would wait for the big request's other IMAGES - threads items.
    assert meanwhile <= threads, (f"{meanwhile} of the big request's {IMAGES} images started decoding between the "
                                  f"small request's probe and its decode (first tokens: small {small_s:.2f} s, "
                                  f"big {big_s:.2f} s): {names}")
