"""Media files named by path, opened so that what is not a regular file is refused instead of blocking the reader.

A path is checked as a regular file when its request is parsed (``orchestrator.inputs``), but the file may be
replaced before it is read: swapped for a FIFO, its open waits for a writer and its read for data, for ever (a fresh
user's break test, swapping an allowed image for a FIFO by rename while requests named it). Here the file is opened
with ``O_NONBLOCK``, which returns at once for a FIFO, and checked on the open descriptor (``fstat``), which no later
swap changes; a regular file's reads then block as usual.

Every media file named by path is opened here: an image for its header probe (``probe.probe_image``) and its read
for decoding (``backends.stages.flashcodec_worker``); a video for each demux, with PyAV reading the open file object
(``probe.open_container``: the probe, the GOP map, the sequential decode, and each ``gop_reader.GopReader``, which
opens the path again where it runs: a GOP-parallel worker process, an NVDEC session thread or helper process).
PyNvVideoCodec decodes only packets PyAV has read; no library opens a video by its name.
"""
from __future__ import annotations

import fcntl
import io
import os
import stat
from pathlib import Path
from typing import BinaryIO

from flashcodec.errors import MediaError


def open_regular(path: str | Path, kind: str) -> BinaryIO:
    """``path`` opened for binary reading, checked as a regular file on the open descriptor.

    Raises MediaError naming ``kind`` ("image", "video") when it cannot be opened (the OS's reason) or is not a
    regular file (a folder, device or pipe).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise MediaError(f"{kind}: the file cannot be read ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise MediaError(f"{kind}: not a regular file (a folder, device or pipe)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_source(source: bytes | str | Path, kind: str) -> BinaryIO:
    """A media source to read: its bytes as an in-memory file, or its path by ``open_regular`` (raises as it does)."""
    return io.BytesIO(source) if isinstance(source, bytes) else open_regular(source, kind)


def read_regular(path: str | Path, kind: str) -> bytes:
    """The whole of the regular file ``path`` (``open_regular``; raises as it does)."""
    with open_regular(path, kind) as f:
        return f.read()


FileStamp = tuple[int, int, int, int, int]  # (device, inode, size in bytes, modification ns, status-change ns)


def file_stamp(status: os.stat_result) -> FileStamp:
    """What names a file's content from its ``os.stat`` result: the file itself (device, inode) and its last write
    (size, modification and status-change times in ns). A file replaced (renamed over) or rewritten gets another,
    even with its old size and modification time put back (``cp -p``, ``tar x``): no user can set the
    status-change time."""
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


def changed_since(path: str | Path, stamp: FileStamp, kind: str) -> str | None:
    """None while ``path`` is still the file ``stamp`` (`file_stamp`) was taken of; else the error to give a
    request that was planned from that file ("video: the file changed ..."), since its plan (frames, sizes, tokens)
    no longer fits what would be decoded."""
    try:
        now = file_stamp(os.stat(path))
    except OSError as exc:
        return f"{kind}: the file cannot be read any more ({exc.strerror}): it was removed while the request ran"
    if now != stamp:
        return (f"{kind}: the file changed while the request ran (replaced or rewritten after it was checked): "
                "send the request again once it is written")
    return None
