"""A media item's identity for the prefix cache (issue 21, item 1): what it holds and how it becomes tokens,
computed without decoding it.

The content: the bytes of an item sent inline (or fetched), hashed whole (BLAKE2b, about 1 GB/s: 35 ms for the
3-minute 720p test video); for a path, which ``allowed_media_dirs`` makes a trusted local file, its resolved path,
device, inode, size, and modification and status-change times (ns): a file rewritten or replaced is a new item, even
with its old size and modification time put back (``cp -p``, ``tar x``), since no user can set the status-change
time. The same content sent by path and as bytes are two items. The preprocessing: the
item's sampling plan (``flashcodec.sampling.VideoPlan`` / ``ImagePlan``: frames chosen, their times, the resize
and ``grid_thw``), which every parameter that changes the item's pixels or tokens (fps, pixel caps, the visual-token
cap) ends up in. The model is the server's one.
"""
from __future__ import annotations

import hashlib
import os

from flashcodec.files import file_stamp
from flashcodec.sampling import ImagePlan, VideoPlan
from orchestrator.inputs import MediaInput
from orchestrator.sampling_params import InvalidInput


def file_key(item: MediaInput) -> tuple[str, int, int, int, int, int]:
    """The content of ``item``'s file (``path`` set) as the module docstring names it: its resolved path, then its
    ``flashcodec.files.file_stamp`` now (device, inode, size in bytes, modification and status-change times in ns).

    Raises:
        InvalidInput: naming the item's input, the file can no longer be read (it was checked with the request).
    """
    path = os.path.realpath(item.path)
    try:
        return path, *file_stamp(os.stat(path))
    except OSError as exc:
        raise InvalidInput(f"{item.input_name}: {item.path} cannot be read ({exc.strerror})") from None


def media_identity(item: MediaInput, plan: VideoPlan | ImagePlan) -> bytes:
    """16 bytes naming ``item``'s content and ``plan``: equal for equal content under the same plan.

    Raises:
        InvalidInput: as `file_key`.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(item.kind.encode() + b"\0" + repr(plan).encode() + b"\0")
    if item.path is not None:
        digest.update("\0".join(map(str, ("path", *file_key(item)))).encode())
    else:
        digest.update(b"data\0" + item.data)
    return digest.digest()
