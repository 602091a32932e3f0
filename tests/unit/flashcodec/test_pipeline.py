"""Pipeline: group by group through any FrameDecoder; patches into the patch pool and back."""
from typing import Iterator, Sequence

import numpy as np
import pytest
import torch

from flashcodec.errors import MediaError
from flashcodec.patch_pool import pages_needed, read_group, write_group
from flashcodec.pipeline import iter_video_groups
from flashcodec.probe import probe_video
from flashcodec.sampling import plan_video
from tests.media import make_video


class FirstFramesOnly:
    """A FrameDecoder whose stream ends early, as a GPU decoder session that lost its input might."""

    def decode(self, source, frame_indices: Sequence[int]) -> Iterator[np.ndarray]:
        for _ in frame_indices[:3]:
            yield np.zeros((48, 64, 3), np.uint8)


def test_a_decoder_that_stops_early_is_a_media_error():
    data = make_video(None, 64, 48, 60, 25)
    plan = plan_video(probe_video(data))
    groups = iter_video_groups(data, plan, decoder=FirstFramesOnly())
    assert next(groups)[0] == 0
    with pytest.raises(MediaError, match="truncated: group 1"):
        next(groups)


def test_groups_round_trip_through_the_patch_pool():
    data = make_video(None, 200, 120, 50, 25)
    plan = plan_video(probe_video(data))
    page_size, free = 64, list(range(40))[::-1]
    pool = torch.zeros(40, page_size, 1176)
    written = {}
    for group, patches in iter_video_groups(data, plan):
        pages = [free.pop() for _ in range(pages_needed(plan.patches_per_group, page_size))]
        write_group(pool, pages, patches)
        written[group] = (pages, patches)
    assert len(written) == plan.num_groups
    for pages, patches in written.values():
        assert torch.equal(read_group(pool, pages, plan.patches_per_group), patches)
