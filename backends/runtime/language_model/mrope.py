"""M-RoPE positions (3-D rotary positions: temporal, height, width) of a prompt, via transformers.

The formula is ``Qwen2_5_VLModel.get_rope_index`` of the installed transformers, called as is, so the
positions equal what ``generate()`` uses. It reads nothing of the model but its config, so a small
stand-in object lends it that config instead of a whole model.
"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel


class _RopeIndex:
    """What ``Qwen2_5_VLModel.get_rope_index`` uses of ``self``: ``config`` and ``get_vision_position_ids``."""

    get_rope_index = Qwen2_5_VLModel.get_rope_index
    get_vision_position_ids = Qwen2_5_VLModel.get_vision_position_ids

    def __init__(self, config: PreTrainedConfig) -> None:
        self.config = config


def mrope_positions(model_config: PreTrainedConfig, input_ids: Sequence[int] | torch.Tensor,
                    image_grid_thw: Sequence[tuple[int, int, int]] = (),
                    video_grid_thw: Sequence[tuple[int, int, int]] = (),
                    second_per_grid_ts: Sequence[float] = ()) -> tuple[torch.Tensor, int]:
    """Positions of a whole prompt and the offset decode continues with.

    ``input_ids``: the prompt (ints, or int64 ``[L]`` on the CPU, used without a copy) with each
    ``<|image_pad|>``/``<|video_pad|>`` already expanded to ``t*h*w / spatial_merge_size**2`` tokens;
    ``image_grid_thw``/``video_grid_thw``: one ``(t, h, w)`` in patches per image/video, in prompt order;
    ``second_per_grid_ts``: seconds per temporal patch of each video. Returns ``(positions, delta)``: int64
    ``[3, L]`` on the CPU, and ``delta`` such that token index ``p >= L`` (generated tokens) has position
    ``p + delta`` on all three axes. Text-only prompts get ``arange(L)`` and ``delta = 0``.

    Note (transformers 5.17): the time step of a video is ``tokens_per_second * int(second_per_grid_t)``,
    so fractional seconds are truncated, and text after a video continues at
    ``start + max(h, w) / merge`` even when the video's temporal positions reach further.

    Raises ValueError when the pad tokens do not match the grids or ``second_per_grid_ts`` does not
    match the videos.
    """
    merge = model_config.vision_config.spatial_merge_size
    ids = torch.as_tensor(input_ids, dtype=torch.long).unsqueeze(0)
    token_type = torch.zeros_like(ids, dtype=torch.int32)
    for modality, token_id, grids in ((1, model_config.image_token_id, image_grid_thw),
                                      (2, model_config.video_token_id, video_grid_thw)):
        is_pad = ids == token_id
        token_type[is_pad] = modality
        expected = sum(t * h * w // merge**2 for t, h, w in grids)
        if int(is_pad.sum()) != expected:
            raise ValueError(f"prompt has {int(is_pad.sum())} pad tokens of id {token_id} but its grids {list(grids)} "
                             f"need {expected}")
    if len(second_per_grid_ts) != len(video_grid_thw):
        raise ValueError(f"{len(video_grid_thw)} videos but {len(second_per_grid_ts)} second_per_grid_ts values")
    positions, deltas = _RopeIndex(model_config).get_rope_index(
        ids,
        mm_token_type_ids=token_type,
        image_grid_thw=torch.tensor(image_grid_thw, dtype=torch.long) if image_grid_thw else None,
        video_grid_thw=torch.tensor(video_grid_thw, dtype=torch.long) if video_grid_thw else None,
        second_per_grid_ts=torch.tensor(second_per_grid_ts, dtype=torch.float32) if video_grid_thw else None,
    )
    return positions[:, 0], int(deltas[0, 0])
