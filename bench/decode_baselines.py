"""The baselines FlashCodec is measured against: other ways to get a video's sampled frames.

Each decodes every frame up to the last sample (none skips GOPs or pictures no sample needs): PyAV with FFmpeg's
threads in one process, OpenCV in one process with its threads, OpenCV in one process per core on keyframe-aligned
parts, and one PyNvVideoCodec ``SimpleDecoder`` session fetching the sampled indices.
"""
from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import torch

from flashcodec.gop import analyse_bitstream


def opencv_sampled(capture, start: int, indices) -> list[np.ndarray]:
    """The frames `indices` (sorted, all >= `start`) as RGB, from an OpenCV `capture` standing at frame `start`:
    every frame up to the last of them is grabbed, the sampled ones retrieved (a repeated index repeats its
    frame). Raises RuntimeError when the stream ends first."""
    import cv2

    wanted, frames = set(indices), {}
    for index in range(start, indices[-1] + 1):
        if not capture.grab():
            raise RuntimeError(f"OpenCV stopped at frame {index}")
        if index in wanted:
            frames[index] = cv2.cvtColor(capture.retrieve()[1], cv2.COLOR_BGR2RGB)
    return [frames[i] for i in indices]


def opencv_frames(path: Path, indices) -> list[np.ndarray]:
    import cv2

    return opencv_sampled(cv2.VideoCapture(str(path)), 0, indices)


def pyav_threaded_frames(path: Path, indices, threads: int):
    """The sampled frames from one PyAV container decoding the whole stream in order with FFmpeg's frame and
    slice threads on `threads` cores (how PyAV-based readers use a host's cores); stops after the last sample."""
    wanted, frames = set(indices), {}
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type, stream.thread_count = "AUTO", threads
        for index, frame in enumerate(container.decode(stream)):
            if index in wanted:
                frames[index] = frame.to_ndarray(format="rgb24")
            if index >= indices[-1]:
                break
    return (frames[i] for i in indices)


def opencv_part(job: tuple[str, int, list[int]]) -> list[np.ndarray]:
    """One worker's part for `opencv_processes`: seek to the keyframe `start` (a frame index), grab every frame
    up to the part's last sampled index, return the sampled ones (RGB)."""
    import cv2

    path, start, indices = job
    cv2.setNumThreads(1)
    capture = cv2.VideoCapture(path)
    capture.set(cv2.CAP_PROP_POS_FRAMES, start)
    return opencv_sampled(capture, start, indices)


def opencv_processes_frames(pool, path: Path, indices):
    """The sampled frames from OpenCV in one process per core (`pool`), each on its own GOPs: the video is cut
    at the keyframes before sampled frames into one part per GOP, the parts are decoded in parallel and come
    back in order (pickled), every frame of a part decoded up to its last sample."""
    starts = [g.key_frame for g in analyse_bitstream(path).gops]
    parts: dict[int, list[int]] = {}
    for i in indices:
        parts.setdefault(max(s for s in starts if s <= i), []).append(i)
    jobs = [(str(path), start, wanted) for start, wanted in sorted(parts.items())]
    for frames in pool.imap(opencv_part, jobs):
        yield from frames


def nvdec_one_session(sessions: dict, path: Path, indices, gpu: int):
    """The sampled frames from one SimpleDecoder session (kept in `sessions` per file, as a server would)."""
    import PyNvVideoCodec as nvc

    if path not in sessions:
        sessions[path] = nvc.SimpleDecoder(str(path), gpu_id=gpu, use_device_memory=True,
                                           output_color_type=nvc.OutputColorType.RGBP)
    decoder = sessions[path]
    unique = sorted(set(indices))
    frames = dict(zip(unique, (torch.from_dlpack(f).clone() for f in decoder.get_batch_frames_by_index(unique))))
    return (frames[i] for i in indices)
