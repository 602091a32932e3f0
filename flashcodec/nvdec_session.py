"""One NVDEC decoder session fed packet by packet: the `gop_reader.PacketDecoder` of FlashCodec's GPU path.

`GopReader` reads a task's packets with PyAV and chooses which to feed (from the keyframe, up to the last
sampled frame, skipping disposable pictures nobody needs); this module hands each one to a PyNvVideoCodec
`CreateDecoder` session (the Video Codec SDK's NvDecoder) as a `PacketData` pointing at the packet's bytes.
MP4/MKV H.264 and HEVC store NAL units length-prefixed; NVDEC's parser takes Annex B, so they go through
FFmpeg's `h264_mp4toannexb` / `hevc_mp4toannexb` bitstream filter (which leaves Annex B input as it is).
The filter writes the parameter sets (SPS/PPS, VPS) only before IDR pictures, so each segment's first packet is
prefixed with those of the stream's header: a segment may start at an open GOP's keyframe, which is no IDR.
Frames come out as NVDEC's native surfaces (NV12, or P016 for 10-bit) and are turned into RGB here, by the
stream's matrix and range as FFmpeg's swscale does it (the CPU reference, and what Qwen2.5-VL's preprocessing
sees): BT.601 where the stream states none. PyNvVideoCodec's own RGB output takes BT.709 there, 4 levels off in
green on HD clips and 17 levels off in blue on 10-bit HEVC.
NVDEC carries each packet's PTS to the frame it completes, which is how frames are matched to the sampled
ones. A packet with no bytes is the end of stream: the parser hands out every frame it holds (the drain
between segments), and the session then takes the next segment from its keyframe.
"""
from __future__ import annotations

from typing import Container

import av
import numpy as np
import torch

# FFmpeg AVColorSpace -> (Kr, Kb) of ITU-R BT.601 / BT.709 / BT.2020; anything else (2: unspecified) is BT.601,
# swscale's default
_MATRIX = {1: (0.2126, 0.0722), 9: (0.2627, 0.0593), 10: (0.2627, 0.0593)}
_BT601 = (0.299, 0.114)
ANNEX_B_FILTERS = {"h264": "h264_mp4toannexb", "hevc": "hevc_mp4toannexb"}  # FFmpeg codec name -> bitstream filter
_NO_BYTES = np.zeros(0, np.uint8)


def parameter_sets(context: av.codec.context.CodecContext) -> bytes:
    """The SPS/PPS (and VPS) of an avcC or hvcC header (ISO/IEC 14496-15, MP4/MKV `extradata`) as Annex B NAL
    units; b"" for other codecs, Annex B streams (which carry them in-band) and malformed headers."""
    extra, units = context.extradata or b"", []
    try:
        if context.name == "h264" and len(extra) > 6 and extra[0] == 1:
            pos = 5  # then: SPS count (low 5 bits), SPS; PPS count, PPS; each unit with a 2-byte length
            for mask in (0x1F, 0xFF):
                count, pos = extra[pos] & mask, pos + 1
                for _ in range(count):
                    size, pos = int.from_bytes(extra[pos:pos + 2], "big"), pos + 2
                    units.append(extra[pos:pos + size])
                    pos += size
        elif context.name == "hevc" and len(extra) > 23 and extra[0] == 1:
            pos = 23  # after the 22-byte record and the array count: per array type, count, units
            for _ in range(extra[22]):
                count, pos = int.from_bytes(extra[pos + 1:pos + 3], "big"), pos + 3
                for _ in range(count):
                    size, pos = int.from_bytes(extra[pos:pos + 2], "big"), pos + 2
                    units.append(extra[pos:pos + size])
                    pos += size
    except IndexError:
        return b""
    return b"".join(b"\0\0\0\1" + unit for unit in units)


def yuv_to_rgb(surface: torch.Tensor, colorspace: int = 2, full_range: bool = False) -> torch.Tensor:
    """An NV12 (uint8) or P016 (16-bit, the sample in the high bits) surface `[H*3/2, W]` as 3xHxW uint8 RGB.

    Luma is the first H rows, interleaved Cb/Cr at half resolution below it; chroma is repeated over its 2x2
    pixels, as swscale's unscaled converter does. `colorspace`: FFmpeg's AVColorSpace (1 BT.709, 9/10 BT.2020,
    others BT.601); `full_range`: JPEG levels (else video levels, 16-235 luma). Matrix: ITU-R BT.601/709/2020
    (Kr, Kb) with Kg = 1 - Kr - Kb. Raises ValueError for a surface whose rows are not a multiple of 3.
    """
    rows, width = surface.shape
    if rows % 3:
        raise ValueError(f"a 4:2:0 surface has H*3/2 rows, got {rows}")
    height = rows * 2 // 3
    if surface.dtype == torch.uint8:
        values = surface.float()
    else:  # P016: reinterpret as int16 (torch has few uint16 kernels), back to 0..65535, scaled to 8-bit levels
        values = (surface.view(torch.int16).to(torch.int32) & 0xFFFF).float() / 256.0
    y = values[:height]
    chroma = values[height:].reshape(height // 2, width // 2, 2).permute(2, 0, 1)
    cb, cr = (c.repeat_interleave(2, 0).repeat_interleave(2, 1)[:height, :width] - 128.0 for c in chroma)
    if not full_range:
        y, cb, cr = (y - 16.0) * (255 / 219), cb * (255 / 224), cr * (255 / 224)
    kr, kb = _MATRIX.get(colorspace, _BT601)
    kg = 1 - kr - kb
    rgb = torch.stack([y + 2 * (1 - kr) * cr,
                       y - (2 * kb * (1 - kb) / kg) * cb - (2 * kr * (1 - kr) / kg) * cr,
                       y + 2 * (1 - kb) * cb])
    return rgb.round_().clamp_(0, 255).to(torch.uint8)


def synchronize(devices) -> None:
    """Wait for the current stream of each CUDA device in `devices` (others are skipped): frames handed to a
    consumer on another thread must be finished there."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


class NvdecPackets:
    """PacketDecoder on `session` (a PyNvVideoCodec decoder made with `usedevicememory=True` and
    `outputColorType=NATIVE`) for packets of `stream`.

    Frames are NVDEC's 4:2:0 surfaces on the session's GPU, copied out (the next `Decode` call reuses them) only
    when their PTS is wanted; `convert` makes one 3xHxW uint8 RGB (`yuv_to_rgb` with the stream's colour space
    and range), turns it upright by `clockwise` quarter turns and moves it to `device` (None: left where
    decoded). `nvc` is the PyNvVideoCodec module (its `PacketData`). Errors from the session propagate.
    """

    def __init__(self, nvc, session, stream: av.video.stream.VideoStream, clockwise: int,
                 device: torch.device | None):
        self.nvc, self.session, self.clockwise, self.device = nvc, session, clockwise, device
        name = ANNEX_B_FILTERS.get(stream.codec_context.name)
        self.bsf = av.BitStreamFilterContext(name, stream) if name else None
        self.header = parameter_sets(stream.codec_context)
        self.colorspace = int(stream.codec_context.colorspace or 2)
        self.full_range = int(stream.codec_context.color_range or 0) == 2  # AVCOL_RANGE_JPEG
        self._segment_start = True  # the next packet starts a segment (its keyframe)
        self.fed = 0  # packets handed to NVDEC (drains not counted)
        self.decoded_on: set[torch.device] = set()  # where the copied frames are (the session's GPU)

    def decode(self, packet: av.Packet | None, wanted: Container[int]) -> list[tuple[int, torch.Tensor]]:
        if packet is None:
            self._segment_start = True
            return self._feed(_NO_BYTES, 0, wanted)
        units = self.bsf.filter(packet) if self.bsf else [packet]
        out = []
        for unit in units:
            self.fed += 1
            data = np.frombuffer(unit, np.uint8)
            if self._segment_start and self.header:
                data = np.frombuffer(self.header + bytes(unit), np.uint8)
            self._segment_start = False
            out += self._feed(data, unit.pts, wanted)
        return out

    def _feed(self, data: np.ndarray, pts: int, wanted: Container[int]) -> list[tuple[int, torch.Tensor]]:
        packet = self.nvc.PacketData()
        packet.bsl_data, packet.bsl, packet.pts = data.ctypes.data if data.size else 0, data.size, pts
        out = []
        for frame in self.session.Decode(packet):  # `data` outlives the call, which reads the bytes
            frame_pts = frame.getPTS()
            if frame_pts in wanted:
                copy = torch.from_dlpack(frame).clone()
                self.decoded_on.add(copy.device)
                out.append((frame_pts, copy))
        return out

    def convert(self, surface: torch.Tensor) -> torch.Tensor:
        frame = yuv_to_rgb(surface, self.colorspace, self.full_range)
        if self.clockwise:
            frame = torch.rot90(frame, k=-self.clockwise, dims=(1, 2)).contiguous()
        return frame if self.device is None else frame.to(self.device, non_blocking=True)
