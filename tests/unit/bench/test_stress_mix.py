"""bench/stress_parts.py: the request mix the stress record states (bench/RESULTS.md, "stress, bursts and soak"),
and the memory reading of a live process (no server)."""
from __future__ import annotations

import os
from collections import Counter

from bench.stress_parts import cancel_after, kind_of, memory_mb


def test_a_burst_of_200_is_150_text_40_images_10_videos_with_one_in_five_of_each_cancelled():
    kinds = Counter(kind_of(i) for i in range(200))
    cancelled = Counter(kind_of(i) for i in range(200) if cancel_after(i) is not None)
    assert kinds == {"text": 150, "image": 40, "video": 10}
    assert cancelled == {"text": 30, "image": 8, "video": 2}
    assert {cancel_after(i) for i in range(200)} == {None, 1, 2, 3}  # mid-stream: after 1 to 3 responses


def test_memory_of_this_process_and_of_none():
    mb = memory_mb(os.getpid())
    assert 0 < mb["anon"] <= mb["rss"] and 0 <= mb["shmem"] <= mb["rss"]
    assert memory_mb(2**22 + 1) is None  # above the kernel's largest pid: no such process
