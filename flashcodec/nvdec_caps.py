"""Whether NVDEC should decode a stream: the stream's format, PyNvVideoCodec's `GetDecoderCaps` per GPU (cached), and
the reason, a stable phrase counted per reason, when a stream goes to the CPU instead.

Imports without PyNvVideoCodec or a GPU (`load_pynvvideocodec` imports the library).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from flashcodec.gop import BitstreamMap

# Member names of PyNvVideoCodec's pybind11 enums (PyNvDecoder.cpp `ENUM_VALUE(cudaVideoChromaFormat, 420)`;
# its samples compare `str(ChromaFormat())` with "cudaVideoChromaFormat.420"): not the C names' YUV420.
CODECS = {"h264": "H264", "hevc": "HEVC", "vp9": "VP9", "av1": "AV1"}  # FFmpeg name -> cudaVideoCodec member
CHROMA = {"420": "420", "422": "422", "444": "444", "gray": "Monochrome"}  # chroma() -> cudaVideoChromaFormat


class NvdecUnavailable(RuntimeError):
    """PyNvVideoCodec cannot be imported, or there is no CUDA GPU for it."""


@dataclass(frozen=True)
class StreamFormat:
    """What a session is made for and frames are turned by: FFmpeg codec name, coded size (pixels), pixel
    format, display rotation (degrees clockwise)."""

    codec: str
    coded_width: int
    coded_height: int
    pix_fmt: str
    rotation: int

    @staticmethod
    def of(bmap: BitstreamMap) -> StreamFormat:
        info = bmap.info
        return StreamFormat(info.codec, info.coded_width, info.coded_height, bmap.pix_fmt, info.rotation)


def chroma(pix_fmt: str) -> str:
    """FFmpeg pixel format -> key of CHROMA ("yuv444p10le" -> "444", "gbrp" -> "444", "nv12" -> "420")."""
    if pix_fmt.startswith("gray"):
        return "gray"
    if "444" in pix_fmt or pix_fmt.startswith("gbr"):
        return "444"
    return "422" if "422" in pix_fmt else "420"


def unsupported_reason(bmap: BitstreamMap, caps: dict | None, caps_error: str = "") -> str:
    """Why NVDEC should not decode `bmap`'s stream ("" if it should); a stable phrase (counted per reason).

    `caps`: `GetDecoderCaps` for its codec, chroma format and bit depth (keys `supported`, `width_min/max`,
    `height_min/max`, `mb_num_max`: 16x16 macroblocks); `caps_error`: why that query failed, if it did.
    """
    info = bmap.info
    fmt = f"{info.codec} {bmap.pix_fmt}"
    if not bmap.exact_timestamps:
        return "packets without unique, unbroken timestamps"
    if info.codec not in CODECS:
        return f"codec {info.codec} is not one FlashCodec decodes on NVDEC"
    if caps_error or not caps:
        return f"the NVDEC capability query for {fmt} failed: {caps_error or 'no answer'}"
    if not caps.get("supported", 1) or caps.get("width_max", 0) <= 0:
        return f"this GPU's NVDEC does not decode {fmt}"
    w, h = info.coded_width, info.coded_height
    if not (caps.get("width_min", 0) <= w <= caps["width_max"] and caps.get("height_min", 0) <= h <= caps.get(
            "height_max", 0)) or -(-w // 16) * -(-h // 16) > caps.get("mb_num_max", 1 << 31):
        return (f"{fmt} size outside this GPU's NVDEC limits ({caps.get('width_min', 0)}x{caps.get('height_min', 0)}"
                f" to {caps['width_max']}x{caps.get('height_max', 0)}, {caps.get('mb_num_max')} macroblocks)")
    return ""


def load_pynvvideocodec(gpu_ids: Sequence[int]):
    """The PyNvVideoCodec module, once every id in `gpu_ids` is a CUDA GPU of this process; else raises
    NvdecUnavailable. The one place `NvdecDecoder` looks at the machine (CPU tests put a stand-in there)."""
    try:
        import PyNvVideoCodec as nvc
    except Exception as exc:  # ImportError, or its CUDA libraries failing to load
        raise NvdecUnavailable(f"PyNvVideoCodec: {type(exc).__name__}: {exc}") from exc
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [g for g in gpu_ids if not 0 <= g < count]
    if missing:
        raise NvdecUnavailable(f"no CUDA GPU {missing[0]} (this process sees {count})")
    return nvc


class DecoderCaps:
    """`GetDecoderCaps` answers of the PyNvVideoCodec module `nvc`, cached per (GPU, codec, chroma format, bit
    depth), since each query creates and destroys a CUDA context (PyNvDecoder.cpp `PyNvDecoderCaps`). Thread-safe."""

    def __init__(self, nvc):
        self.nvc = nvc
        self._lock = threading.Lock()
        self._cache: dict[tuple[int, str, str, int], tuple[dict | None, str]] = {}

    def query(self, gpu: int, codec: str, pix_fmt: str, bit_depth: int) -> tuple[dict | None, str]:
        """(the answer on GPU `gpu` for FFmpeg codec `codec`, pixel format `pix_fmt`, `bit_depth` bits, "") or
        (None, why the query failed)."""
        key = (gpu, codec, chroma(pix_fmt), bit_depth)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        nvc = self.nvc
        try:
            answer = (dict(nvc.GetDecoderCaps(
                gpuid=gpu, codec=getattr(nvc.cudaVideoCodec, CODECS[codec]),
                chromaformat=getattr(nvc.cudaVideoChromaFormat, CHROMA[key[2]]), bitdepth=bit_depth)), "")
        except Exception as exc:  # an enum this build lacks, or the driver refusing the query
            answer = (None, f"{type(exc).__name__}: {exc}")
        with self._lock:
            self._cache[key] = answer
        return answer

    def why_not(self, bmap: BitstreamMap, gpu_ids: Sequence[int]) -> str:
        """`unsupported_reason` for `bmap` on the GPUs `gpu_ids` ("" when NVDEC should decode it): the reason of the
        first GPU that refuses it, since a session on any of them may get any of its tasks."""
        if bmap.info.codec not in CODECS:
            return unsupported_reason(bmap, None)
        for gpu in gpu_ids:
            reason = unsupported_reason(bmap, *self.query(gpu, bmap.info.codec, bmap.pix_fmt, bmap.bit_depth))
            if reason:
                return reason
        return ""
