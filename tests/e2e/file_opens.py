"""The order in which any process opens the files of one folder (Linux inotify through ctypes): what a test of the
server's decode order can watch without the server's help."""
from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
import time
from pathlib import Path

IN_OPEN = 0x20
IN_CLOSE_NOWRITE = 0x10  # watched too: identical events in a row are merged, an open and a close are not
IN_NONBLOCK = os.O_NONBLOCK  # inotify_init1's flag has the value of O_NONBLOCK
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name


class FileOpens:
    """A context manager recording, in order, each open of a file of ``folder`` (by any process) while it is open.
    ``events()``: (``time.monotonic()`` seconds when read, file name) of each open so far. Two opens of one name with
    no close between them may count once (inotify merges identical events), so give files opened at once names of
    their own (hard links). Raises OSError when inotify cannot watch the folder."""

    def __init__(self, folder: Path):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(IN_NONBLOCK)
        if self._fd < 0 or self._libc.inotify_add_watch(self._fd, str(folder).encode(), IN_OPEN | IN_CLOSE_NOWRITE) < 0:
            raise OSError(ctypes.get_errno(), f"inotify cannot watch {folder}")
        self._events: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="file-opens", daemon=True)

    def __enter__(self) -> "FileOpens":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        os.close(self._fd)

    def events(self) -> list[tuple[float, str]]:
        with self._lock:
            return list(self._events)

    def _read(self) -> None:
        while not self._stop.is_set():
            if not select.select([self._fd], [], [], 0.05)[0]:
                continue
            data, offset, now, events = os.read(self._fd, 65536), 0, time.monotonic(), []
            while offset < len(data):
                _, mask, _, length = _EVENT.unpack_from(data, offset)
                start = offset + _EVENT.size
                if mask & IN_OPEN:
                    events.append((now, data[start:start + length].rstrip(b"\0").decode()))
                offset = start + length
            with self._lock:
                self._events += events
