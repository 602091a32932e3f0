"""Stand-ins for PyNvVideoCodec on the CPU, shared by the NVDEC unit tests: an H200's `GetDecoderCaps` answers,
the enums and sessions of PyNvVideoCodec 2.x (sessions decode with PyAV and return NVDEC's native surfaces), and
`NvdecDecoder`s built on them, where a GPU id is only a label and frames stay on the CPU."""
import ctypes
import threading
from collections import deque
from types import SimpleNamespace

import numpy as np
import torch

from flashcodec import nvdec
from flashcodec.decoders import CpuDecoder, DecodePaths
from flashcodec.nvdec import NvdecDecoder
from flashcodec.nvdec_caps import CHROMA, CODECS, DecoderCaps
from tests.media import all_frames, make_video
from tests.unit.flashcodec.test_gop import encode

# GetDecoderCaps on an H100/H200 (NVDEC support matrix, Video Codec SDK 13): no AV1, no 4:4:4 H.264
H264 = {"supported": 1, "num_decoder_engines": 7, "width_min": 48, "height_min": 16, "width_max": 4096,
        "height_max": 4096, "mb_num_max": 65536}
HEVC = {**H264, "width_min": 144, "height_min": 144, "width_max": 8192, "height_max": 8192, "mb_num_max": 262144}
VP9 = {**HEVC, "width_min": 128, "height_min": 128}
UNSUPPORTED = {"supported": 0, "num_decoder_engines": 7, "width_min": 0, "height_min": 0, "width_max": 0,
               "height_max": 0, "mb_num_max": 0}
H200 = {("h264", "420", 8): H264, ("hevc", "420", 8): HEVC, ("hevc", "420", 10): HEVC, ("vp9", "420", 8): VP9}


def h200_caps(codec: str, chroma: str, depth: int) -> dict:
    return H200.get((codec, chroma, depth), UNSUPPORTED)


OPEN_GOPS = [
    lambda: make_video(None, 320, 240, 60, 25, codec="libx265", gop=12, bframes=3),  # x265 defaults to open GOPs
    lambda: encode("libx264", {"x264-params": "open-gop=1"}),
]
VARIABLE_RATE = [0, 0.04, 0.08, 0.2, 0.24, 0.28, 0.4, 0.44, 0.6, 0.64]


class FakeEnum:
    """A pybind11 enum as PyNvVideoCodec 2.x declares it: members are class attributes, any string as a name."""

    def __init__(self, name: str, members: list[str]):
        for value, member in enumerate(members):
            setattr(self, member, SimpleNamespace(enum=name, name=member, value=value))


class FakeNvc:
    """The part of PyNvVideoCodec `DecoderCaps` uses: enum member names from PyNvDecoder.cpp (`Init_PyNvDecoder`), and
    `GetDecoderCaps(gpuid, codec, chromaformat, bitdepth) -> Dict[str, int]` (its pybind signature and docstring
    in the 2.2.4 wheel; keys from `PyNvDecoderCaps`), answering as an H200 would."""

    cudaVideoCodec = FakeEnum("cudaVideoCodec", ["MPEG1", "MPEG2", "MPEG4", "VC1", "H264", "JPEG", "H264_SVC",
                                                 "H264_MVC", "HEVC", "VP8", "VP9", "AV1"])
    cudaVideoChromaFormat = FakeEnum("cudaVideoChromaFormat", ["Monochrome", "420", "422", "444"])

    def __init__(self):
        self.queries = []

    def GetDecoderCaps(self, *, gpuid: int, codec, chromaformat, bitdepth: int) -> dict:
        assert codec.enum == "cudaVideoCodec" and chromaformat.enum == "cudaVideoChromaFormat"
        self.queries.append((codec.name, chromaformat.name, bitdepth))
        return dict(h200_caps({v: k for k, v in CODECS.items()}[codec.name],
                              {v: k for k, v in CHROMA.items()}[chromaformat.name], bitdepth))


def bare_decoder(paths: DecodePaths, nvc=None) -> NvdecDecoder:
    """An NvdecDecoder as __init__ leaves it, on the CPU and without PyNvVideoCodec: enough to decide and fall back."""
    decoder = object.__new__(NvdecDecoder)
    decoder.nvc, decoder.gpu_ids, decoder.output_device = nvc or FakeNvc(), (0,), torch.device("cpu")
    decoder.caps = DecoderCaps(decoder.nvc)
    decoder.fallback, decoder.paths, decoder.fallbacks = CpuDecoder(paths=paths), paths, deque(maxlen=100)
    return decoder


class FakeFrame:
    """A DecodedFrame: `getPTS()` (packet PTS, stream ticks) and DLPack export of its surface."""

    def __init__(self, pts: int, surface: np.ndarray):
        self.pts, self.surface = pts, torch.from_numpy(surface)

    def getPTS(self) -> int:  # noqa: N802 (PyNvVideoCodec's name)
        return self.pts

    def __dlpack__(self, **kwargs):
        return self.surface.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.surface.__dlpack_device__()


def native_surface(frame) -> np.ndarray:
    """NVDEC's native output for a decoded 4:2:0 frame: NV12 `[H*3/2, W]` uint8, or P016 (uint16, the 10-bit
    sample shifted to the high bits) for deeper streams."""
    deep = frame.format.components[0].bits > 8
    dtype = np.uint16 if deep else np.uint8

    def plane(k):
        p = frame.planes[k]
        return np.frombuffer(p, dtype).reshape(p.height, p.line_size // dtype().itemsize)[:, :p.width]

    y, u, v = plane(0), plane(1), plane(2)
    surface = np.vstack([y, np.stack([u, v], axis=-1).reshape(u.shape[0], -1)])
    return (surface << 6).astype(np.uint16) if deep else surface


class FakePacketData:
    """PyNvVideoCodec's PacketData: a pointer to the packet's bytes, their count, the PTS."""

    bsl_data = bsl = pts = 0


class FakeSession:
    """A `CreateDecoder` session as nvdec_session.py uses it, on PyAV: `Decode(PacketData)` reads the bytes at
    `bsl_data`, which must be Annex B for H.264/HEVC (NVDEC's parser takes nothing else), decodes them with FFmpeg
    and returns the frames they complete, carrying the packet's PTS; a packet with no bytes drains (end of
    stream) and the next one starts afresh. Frames keep the stored orientation (NVDEC ignores the display
    matrix) and stay on the CPU whatever `gpuid`, which is kept with the thread that made the session (a GPU id
    is only a label here). `fed` lists the PTS fed, None at each drain. `lose`: return no frame at all."""

    made: list = []
    lose = False

    def __init__(self, *, gpuid, codec, usedevicememory, outputColorType):
        import av

        assert usedevicememory and outputColorType == "NATIVE"
        self.gpu_id, self.thread, self.fed = gpuid, threading.current_thread().name, []
        self.codec_name = {"H264": "h264", "HEVC": "hevc", "VP9": "vp9"}[codec.name]
        self.codec = av.CodecContext.create(self.codec_name, "r")
        FakeSession.made.append(self)

    def Decode(self, packet):  # noqa: N802 (PyNvVideoCodec's name)
        import av

        if not packet.bsl:
            self.fed.append(None)
            frames = self.codec.decode(None)
            self.codec.flush_buffers()
        else:
            data = ctypes.string_at(packet.bsl_data, packet.bsl)
            assert self.codec_name == "vp9" or data[:4] == b"\0\0\0\1" or data[:3] == b"\0\0\1", "not Annex B"
            self.fed.append(packet.pts)
            unit = av.Packet(data)
            unit.pts = packet.pts
            frames = self.codec.decode(unit)
        return [] if self.lose else [FakeFrame(f.pts, native_surface(f)) for f in frames]


class FakeNvcWithDecoder(FakeNvc):
    PacketData = FakePacketData
    OutputColorType = SimpleNamespace(NATIVE="NATIVE")

    def CreateDecoder(self, **kwargs):  # noqa: N802 (PyNvVideoCodec's name)
        return self.Session(**kwargs)

    Session = FakeSession


def fake_decoder(monkeypatch, gpu_ids=0, sessions_per_gpu=2, nvc=FakeNvcWithDecoder, **kwargs) -> NvdecDecoder:
    """A real NvdecDecoder on `nvc` (default FakeSession sessions, H200 caps), GPU ids as labels, frames
    (output_device) on the CPU; its fallback shares its DecodePaths."""
    FakeSession.made, FakeSession.lose = [], False
    monkeypatch.setattr(nvdec, "load_pynvvideocodec", lambda ids: nvc())
    paths = DecodePaths()
    return NvdecDecoder(gpu_ids, sessions_per_gpu, kwargs.pop("max_gop_size", 20), CpuDecoder(paths=paths), paths,
                        **{"window": 4, "output_device": "cpu", **kwargs})


def assert_cpu_frames(frames, source, indices, turn=0):
    """The CPU reference's frames, up to `yuv_to_rgb`'s rounding against swscale (under two levels on average; a
    neighbouring frame of these clips differs by several)."""
    assert len(frames) == len(indices)
    for index, frame in zip(indices, frames):
        expected = np.rot90(all_frames(source)[index], k=-turn)
        assert frame.shape == (3, *expected.shape[:2])
        error = np.abs(frame.permute(1, 2, 0).numpy().astype(int) - expected).mean(axis=(0, 1))
        assert (error < 2.0).all(), (index, error)
