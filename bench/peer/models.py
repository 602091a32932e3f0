"""The models the peer benchmark can serve (``run.py --model``), each with both systems' settings for it.

| model | checkpoint | KV pages (UnifiedServe) | max-model-len | vLLM batched tokens | a video |
|---|---|---|---|---|---|
| ``qwen2_5_vl_7b`` (default) | Qwen2.5-VL-7B | 16,384 | 128,000 | 110,000 | 2 fps |
| ``internvl3_8b`` | InternVL3-8B-hf | 16,384 | 32,768 | 8,192 | 64 frames |
| ``internvl3_38b`` | InternVL3-38B-hf | 8,192 | 32,768 | 8,192 | 64 frames |

Qwen2.5-VL-7B's settings are the serve bench's (``bench.serve_bench.FULL_SETUP``; vLLM's reasons in
``bench/peer/servers.py``). InternVL3's:

* **Frames** (``INTERNVL_FRAMES`` = 64): InternVL3 cuts a video into a fixed number of segments, one 448-px tile
  (256 tokens) a frame, whatever its length, so the 3-minute video is 64 frames, 16,384 visual tokens: the heaviest
  request of the benchmark (a 1280x720 image is 9 tiles, 2,304 tokens) and twice vLLM's default of 32, within
  max_model_len with room for 16 text streams beside it. UnifiedServe takes the count per request
  (``mm_processor_kwargs.num_frames``, ``VIDEO_KWARGS``: its default is 8); vLLM 0.26's video loader
  (``vllm/multimodal/media/video.py``, ``VideoMediaIO(num_frames=32)``; the OpenCV ``VideoBackend`` of
  ``vllm/multimodal/video.py`` takes ``min(num_frames, total)`` frames by ``np.linspace``) samples them before the
  HF processor, whose ``InternVLVideoProcessor`` has ``do_sample_frames`` off and keeps every frame it is given, so
  ``--media-io-kwargs '{"video": {"num_frames": 64}}'`` sets it (the request's ``mm_processor_kwargs`` reach that
  processor, which does not sample). The same count, other frames: vLLM's are evenly spaced from the first to
  the last, UnifiedServe's (and transformers') are the segments' middles; the token counts are equal.
* **Lengths**: InternVL3's language models have 32,768 positions (``max_position_embeddings``), vLLM's limit for
  ``--max-model-len``; UnifiedServe the same. vLLM's encoder cache is sized by its profiling video, (32,768 - one
  13-tile image's 3,328) / 256 = 115 frames, so a 64-frame video fits it at vLLM's default ``--max-num-batched-
  tokens`` for an H200 API server, 8,192 (``vllm/engine/arg_utils.py``), written out here.
* **KV pages** (16 tokens each): InternVL3-38B's language model (Qwen2.5-32B: 64 layers, 8 KV heads of 128) holds
  256 KiB a token, 4 MiB a page; 8,192 pages (131,072 tokens, 32 GiB) beside its 72 GiB (77 GB) of bf16 weights,
  held once (``decode.share_weights``), leave about 36 GiB of the H200's 140 GiB for activations, CUDA graphs and
  the other stages; they hold every fixed scenario (the most at once: 16 images of 2,304 tokens and 16 text
  streams, about 45,000 tokens) and 7 of the multiturn scenario's 64-frame clips. InternVL3-8B's (Qwen2.5-7B)
  holds 56 KiB a token: 16,384 pages are 14 GiB, as Qwen2.5-VL-7B's. Budgets: the family's defaults (encode 5,120
  patches, prefill 2,048 tokens; ``flashcodec.families``: ``Family.budgets``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from bench.serve_bench import FULL_SETUP

INTERNVL_FRAMES = 64
MEDIA_LIMITS = '{"image": 2, "video": 1}'  # the goodput test's requests hold up to 2 images
DEFAULT = "qwen2_5_vl_7b"


@dataclass(frozen=True)
class PeerModel:
    """One model's settings: ``preset`` (``backends.runtime.presets``; the checkpoint's ``config.json``),
    ``unifiedserve`` (the launcher's ``--set`` items), ``vllm`` (arguments of vLLM's API server),
    ``video_kwargs`` (the ``mm_processor_kwargs`` every request holding a video carries, to both systems),
    ``deploy``: the H200 deployment file (in ``deploy/``) whose scheduling settings UnifiedServe is served with
    (``servers.h200_scheduling``)."""

    preset: str
    unifiedserve: tuple[str, ...]
    vllm: tuple[str, ...]
    video_kwargs: dict = field(default_factory=dict)
    deploy: str = "qwen2_5_vl_7b_h200.yaml"

    @property
    def checkpoint_dir(self) -> str:
        """The checkpoint's folder name under the bench's work folder."""
        return f"{self.preset}_dummy"


def _internvl3(preset: str, kv_pages: int, deploy: str = PeerModel.deploy) -> PeerModel:
    media_io = json.dumps({"video": {"num_frames": INTERNVL_FRAMES}})
    return PeerModel(preset, (f"*.preset={preset}", "*.dtype=bfloat16", f"decode.kv_pages={kv_pages}",
                              "orchestrator.max_model_len=32768"),
                     ("--max-model-len", "32768", "--limit-mm-per-prompt", MEDIA_LIMITS,
                      "--max-num-batched-tokens", "8192", "--media-io-kwargs", media_io),
                     {"num_frames": INTERNVL_FRAMES}, deploy)


MODELS = {
    # vLLM 0.26 refuses the 3-minute video's 106,920 visual tokens below 110,000 batched tokens (its encoder cache
    # follows this budget); its loader already samples Qwen's 2 fps (360 frames of the 3-minute video) and hands
    # the HF processor frames without their metadata: sampling again there fails ("Asked to sample `fps` frames
    # per second but no video metadata was provided"), so the processor is told not to (seen on the H200,
    # 2026-12-01: then 107,002 prompt tokens, as UnifiedServe counts)
    DEFAULT: PeerModel(DEFAULT, FULL_SETUP.overrides,
                       ("--max-model-len", "128000", "--limit-mm-per-prompt", MEDIA_LIMITS,
                        "--max-num-batched-tokens", "110000", "--mm-processor-kwargs", '{"do_sample_frames": false}')),
    "internvl3_8b": _internvl3("internvl3_8b", 16384),
    "internvl3_38b": _internvl3("internvl3_38b", 8192, "internvl3_38b_h200.yaml"),
}
