"""The GOP map of a video from one demux pass: where each GOP starts, what it costs, which frames it holds.

A GOP runs from a keyframe packet to the packet before the next keyframe, in decode order. It is *open* when a
packet after its keyframe has a lower PTS than the keyframe: leading B-frames that are shown before the keyframe
and reference the previous GOP (x264 `open-gop`, HEVC CRA); they decode correctly only after that GOP.
A packet is *disposable* when no other picture references it (H.264 `nal_ref_idc` 0; HEVC sub-layer
non-reference NAL types in a single-layer stream): a decoder may skip it unless that frame itself is wanted.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import av

from flashcodec.probe import (PacketMeta, Source, VideoInfo, info_from_packets, open_container, scan_packets,
                             unwrapped_pts)


@dataclass(frozen=True)
class Gop:
    """One GOP. Packets `first_packet` .. `first_packet + num_frames - 1` in decode order (one frame each).

    `byte_start`/`byte_end`: file offsets (bytes) spanning its packets, end exclusive; -1 when the container does
    not report positions. `num_bytes`: sum of its packet sizes. `pts_start_s`/`pts_end_s`: PTS in seconds of its
    first and last frame in presentation order (stream time, not shifted to 0). `first_frame`: presentation index
    of its earliest frame; `key_frame`: presentation index of its keyframe; frames of the GOP with presentation
    index < `key_frame` are its leading frames (only an open GOP has any).
    """

    index: int
    first_packet: int
    num_frames: int
    byte_start: int
    byte_end: int
    num_bytes: int
    pts_start_s: float
    pts_end_s: float
    first_frame: int
    key_frame: int
    open: bool

    @property
    def last_packet(self) -> int:
        return self.first_packet + self.num_frames - 1


@dataclass(frozen=True)
class BitstreamMap:
    """A video stream's GOPs and per-packet timing, from `analyse_bitstream`.

    `info`: the probe's metadata (codec, rotation, average fps, duration in s, variable-frame-rate flag, sizes,
    every frame's PTS in s). `profile` (FFmpeg's name, "" if unknown), `pix_fmt` (chroma format and depth, e.g.
    "yuv420p", "yuv444p10le") and `bit_depth` (bits per luma sample) say what a hardware decoder must support.
    Per packet in decode order: `packet_pts`/`packet_dts` (ticks of `time_base`, None where the container has
    none), `packet_gop` (its GOP's index). `frame_packet[i]`: the decode-order packet of presentation index i
    (the order of `info.frame_pts_s`). `packet_disposable`: per packet, no other picture references it (read
    from the NAL headers of MP4/MKV-style H.264 and HEVC; always False for other codecs and Annex B streams).
    `exact_timestamps`: every packet has a PTS, no two share one and they never restart (`probe.unwrapped_pts`), so
    frames can be matched to packets by PTS; when False the GOP decoders fall back to a sequential decode.
    """

    info: VideoInfo
    profile: str
    pix_fmt: str
    bit_depth: int
    time_base: Fraction
    gops: tuple[Gop, ...]
    packet_pts: tuple[int | None, ...]
    packet_dts: tuple[int | None, ...]
    packet_gop: tuple[int, ...]
    frame_packet: tuple[int, ...]
    packet_disposable: tuple[bool, ...]
    exact_timestamps: bool

    def gop_of_frame(self, frame: int) -> Gop:
        """The GOP holding presentation index `frame` (0 <= frame < info.num_frames; IndexError otherwise)."""
        return self.gops[self.packet_gop[self.frame_packet[frame]]]


def _presentation_order(pts: list[int | None]) -> list[int]:
    """Decode-order packet indices sorted by PTS; without PTS everywhere, decode order (as `probe_video` counts)."""
    if any(p is None for p in pts):
        return list(range(len(pts)))
    return sorted(range(len(pts)), key=lambda i: (pts[i], i))


def _nal_layout(context: av.codec.context.CodecContext) -> tuple[int, bool] | None:
    """(NAL length-prefix size in bytes, HEVC?) of a length-prefixed H.264 (avcC) or single-layer HEVC (hvcC)
    stream, from its extradata (ISO/IEC 14496-15); None when disposable pictures cannot be told."""
    extra = context.extradata or b""
    if context.name == "h264" and len(extra) > 4 and extra[0] == 1:
        return (extra[4] & 3) + 1, False
    # HEVC sub-layer non-reference pictures may be referenced from higher temporal layers: one layer only
    if context.name == "hevc" and len(extra) > 22 and extra[0] == 1 and (extra[21] >> 3) & 7 == 1:
        return (extra[21] & 3) + 1, True
    return None


def _disposable(data: memoryview, length_size: int, hevc: bool) -> bool:
    """Whether the picture in this access unit (length-prefixed NAL units) is referenced by no other."""
    pos = 0
    while pos + length_size < len(data):
        size = int.from_bytes(data[pos : pos + length_size], "big")
        pos += length_size
        if not size or pos + size > len(data):
            return False
        head = data[pos]
        if hevc and head >> 1 & 0x3F < 32:  # the first VCL NAL: TRAIL_N, TSA_N, STSA_N, RADL_N, RASL_N, RSV_N
            return head >> 1 & 0x3F <= 14 and head >> 1 & 1 == 0
        if not hevc and head & 0x1F in (1, 5):  # the first slice: nal_ref_idc 0 means a non-reference picture
            return head >> 5 == 0
        pos += size
    return False


def _gops(packets: list[PacketMeta], frame_of_packet: list[int], time_base: Fraction) -> list[Gop]:
    starts = [0] + [i for i, p in enumerate(packets) if p.is_keyframe and i > 0]
    gops = []
    for index, (start, end) in enumerate(zip(starts, starts[1:] + [len(packets)])):
        members = packets[start:end]
        frames = frame_of_packet[start:end]
        positions = [(p.pos, p.pos + p.size) for p in members if p.pos is not None and p.pos >= 0]
        key_pts = members[0].pts
        shown = [p.pts for p in members if p.pts is not None] or [0]
        gops.append(Gop(
            index=index,
            first_packet=start,
            num_frames=end - start,
            byte_start=min(a for a, _ in positions) if positions else -1,
            byte_end=max(b for _, b in positions) if positions else -1,
            num_bytes=sum(p.size for p in members),
            pts_start_s=float(min(shown) * time_base),
            pts_end_s=float(max(shown) * time_base),
            first_frame=min(frames),
            key_frame=frames[0],
            # a later packet shown before the keyframe: a leading frame that references the previous GOP
            open=key_pts is not None and any(p.pts is not None and p.pts < key_pts for p in members[1:]),
        ))
    return gops


def analyse_bitstream(source: Source) -> BitstreamMap:
    """The GOP map of `source`'s first video stream from one demux pass (`probe.scan_packets`: packet data is
    let go as the pass goes, once each packet's disposability has been read from its NAL headers).

    No GOP is decoded; the first frame is, by `probe.info_from_packets`, for the display rotation (PyAV exposes
    it on frames only) and to prove the stream decodable. Packets before the first keyframe (a stream cut
    before its keyframe) belong to GOP 0, which therefore always starts at packet 0. Raises MediaError as
    `probe_video` does.
    """
    with open_container(source) as container:
        stream = container.streams.video[0]
        context = stream.codec_context
        layout = _nal_layout(context)

        def disposable(packet: av.Packet) -> bool:
            return bool(layout) and not packet.is_keyframe and _disposable(memoryview(packet), *layout)

        packets, first = scan_packets(container, disposable)
        info = info_from_packets(stream, packets, first)
        time_base = stream.time_base or Fraction(0)
        pts = [p.pts for p in packets]
        shown = unwrapped_pts(packets)
        order = _presentation_order(shown)
        frame_of_packet = [0] * len(packets)
        for frame, packet in enumerate(order):
            frame_of_packet[packet] = frame
        gops = _gops(packets, frame_of_packet, time_base)
        packet_gop = [g.index for g in gops for _ in range(g.num_frames)]
        fmt = context.format
        return BitstreamMap(
            info=info,
            profile=context.profile or "",
            pix_fmt=fmt.name if fmt else "",
            bit_depth=max((c.bits for c in fmt.components), default=8) if fmt else 8,
            time_base=time_base,
            gops=tuple(gops),
            packet_pts=tuple(pts),
            packet_dts=tuple(p.dts for p in packets),
            packet_gop=tuple(packet_gop),
            frame_packet=tuple(order),
            packet_disposable=tuple(p.flag for p in packets),
            exact_timestamps=None not in pts and len(set(pts)) == len(pts) and shown == pts,
        )


def map_for_indices(source: Source, frame_indices) -> tuple[list[int], "BitstreamMap | None"]:
    """The checked frame indices and the GOP map a GOP decoder needs; the map is None when there is
    nothing to decode. Raises ValueError for indices out of order, MediaError for one past the last frame."""
    from flashcodec.decoders import check_indices
    from flashcodec.errors import MediaError

    indices = list(frame_indices)
    check_indices(indices)
    if not indices:
        return indices, None
    bmap = analyse_bitstream(source)
    if indices[-1] >= bmap.info.num_frames:
        raise MediaError(f"video: frame index {indices[-1]} is past the last frame ({bmap.info.num_frames} frames)")
    return indices, bmap
