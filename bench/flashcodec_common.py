"""What the FlashCodec benchmarks share about one timed decoder run: the patches made on the device, the peak
device memory it took, the check that it decoded on its own path, and what the decoder reports (fallbacks,
NVDEC session rates)."""
from __future__ import annotations

import sys
import threading

import numpy as np
import torch

from flashcodec.preprocess import normalize, patchify_group, resize_frames

# the decode path each method must take for its name to stand; methods without DecodePaths run on one path
EXPECTED_PATH = {"flashcodec_nvdec": "nvdec", "flashcodec_nvdec_2proc": "nvdec", "pyav_gop_parallel": "cpu_parallel",
                 "pyav_sequential": "cpu"}


def patchify(frames, plan, device: torch.device | None) -> int:
    """Qwen2.5-VL patches of `frames` (numpy HxWx3 or 3xHxW tensors) on `device`; returns the patch rows.
    `device` None: only consume the frames (decode-only timing)."""
    rows, pair = 0, []
    for frame in frames:
        if device is None:
            rows += plan.patches_per_group if len(pair) else 0
            pair = [] if pair else [frame]
            continue
        if isinstance(frame, np.ndarray):
            frame = torch.from_numpy(frame).permute(2, 0, 1)
        pair.append(frame.to(device, non_blocking=True))
        if len(pair) == 2:
            pixels = resize_frames(torch.stack(pair), plan.resized_height, plan.resized_width)
            rows += patchify_group(normalize(pixels)).shape[0]
            pair = []
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return rows


def device_memory_used(device: torch.device) -> int:
    """Bytes in use on `device` by every allocator (NVDEC surfaces too), after torch's cache is emptied (blocks
    torch keeps from earlier runs would otherwise hide what a run takes); 0 off the GPU."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free


class PeakMemory:
    """Peak device memory taken (bytes, all allocators: NVDEC surfaces too) while the block runs, above what was
    in use when it started (`base`, measured with torch's cache emptied)."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self.base, self._stop = device, 0, 0, threading.Event()

    def __enter__(self):
        if self.device.type == "cuda":
            self.base = device_memory_used(self.device)
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.01):
            free, total = torch.cuda.mem_get_info(self.device)
            self.peak = max(self.peak, total - free - self.base)

    def __exit__(self, *exc):
        self._stop.set()
        if self.device.type == "cuda":
            self._thread.join()


def checked_label(method: str, used: dict) -> str:
    """`method`, or `<method>_FELL_BACK_TO_<paths>` when any video of its runs (warm-up included) was decoded on
    a path other than the method's own (`used`: videos per path): a CPU fallback is never reported as NVDEC."""
    expected = EXPECTED_PATH.get(method)
    others = sorted(set(used) - {expected}) if expected else []
    if not others and (not expected or used.get(expected)):
        return method
    label = f"{method}_FELL_BACK_TO_{'+'.join(others) or 'nothing'}"
    print(f"WARNING: {method} did not decode on the {expected} path (paths {used}): reported as {label}",
          file=sys.stderr, flush=True)
    return label


def fallbacks(decoder) -> dict:
    """The decoder's fallbacks: per (path, reason) the videos, and the latest with their details (NVDEC)."""
    paths = getattr(decoder, "paths", None)
    counted = paths.fallbacks() if paths is not None else {}
    if not counted:
        return {}
    return {"fallbacks": [{"path": p, "reason": r, "videos": n} for (p, r), n in counted.items()],
            "fallback_details": [list(f) for f in getattr(decoder, "fallbacks", [])]}


def session_rates(decoder) -> dict:
    stats = decoder.session_stats() if hasattr(decoder, "session_stats") else []
    if not stats:
        return {}
    return {"nvdec_sessions": len(stats), "nvdec_frames_per_s_per_session": [s.packets / s.busy_s for s in stats],
            "nvdec_busy_s": [s.busy_s for s in stats]}
