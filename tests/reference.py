"""The reference the server is held to: transformers' own ``generate()`` on the same dummy weights and
the same preprocessed inputs, plus the tie rule (the end-to-end tests' acceptance rule: tokens equal, except
where the reference's two best logits at the first differing step are within 1e-4)."""
from __future__ import annotations

from collections import Counter

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from orchestrator.sampling_params import RequestParams

TIE = 1e-4  # logits closer than this may be ordered either way by float rounding


class PresenceFrequencyPenalty(LogitsProcessor):
    """vLLM's presence and frequency penalties as its docs define them (after OpenAI's), written out for the
    reference: ``logits -= frequency * count`` then ``logits -= presence * (count > 0)``, ``count`` being each
    token's occurrences among the generated tokens (those after the first ``prompt_len`` ids)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids[:, self.prompt_len:].tolist()):
            for token, count in Counter(ids).items():
                scores[row, token] -= torch.tensor(self.frequency, dtype=scores.dtype) * count
                scores[row, token] -= torch.tensor(self.presence, dtype=scores.dtype)
        return scores


def media_kwargs(model, ids: torch.Tensor, *, video=None, image=None, tiles=None) -> dict:
    """The model's media arguments (``reference_generate``'s ``video``, ``image``, ``tiles``) on its device, with each
    token's modality for M-RoPE (Qwen2.5-VL; transformers 5.17 computes M-RoPE only when given it)."""
    device = model.device
    kwargs = {}
    if video is not None:
        pixels, grid, seconds = video
        kwargs.update(pixel_values_videos=pixels.to(device), video_grid_thw=torch.tensor([grid], device=device),
                      second_per_grid_ts=torch.tensor([seconds], device=device))
    if image is not None:
        pixels, grid, _ = image
        kwargs.update(pixel_values=pixels.to(device), image_grid_thw=torch.tensor([grid], device=device))
    if tiles is not None:
        kwargs.update(pixel_values=tiles.to(device))
    if hasattr(model.config, "video_token_id"):  # M-RoPE (Qwen2.5-VL; InternVL3's positions are 1-D)
        kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).int() + 2 * (
            ids == model.config.video_token_id).int()
    return kwargs


def reference_generate(model, input_ids: list[int], max_new_tokens: int, *, video=None, image=None, tiles=None,
                       params: RequestParams = RequestParams()):
    """Greedy ``generate()`` without EOS, with ``params``' penalties (transformers' own repetition penalty,
    :class:`PresenceFrequencyPenalty`); ``video``/``image`` (Qwen2.5-VL): (pixel rows [n, 1176] float32, grid_thw,
    second_per_grid_t); ``tiles`` (InternVL3): ``pixel_values`` float32 [tiles, 3, 448, 448], every image's tiles and
    video frame of the prompt in order. Returns (token ids, per-step scores [vocab]: the logits after the
    penalties)."""
    ids = torch.tensor([input_ids], device=model.device)
    kwargs = media_kwargs(model, ids, video=video, image=image, tiles=tiles)
    if params.presence_penalty or params.frequency_penalty:
        kwargs["logits_processor"] = LogitsProcessorList([
            PresenceFrequencyPenalty(len(input_ids), params.presence_penalty, params.frequency_penalty)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None, output_scores=True,
                         repetition_penalty=params.repetition_penalty, return_dict_in_generate=True, **kwargs)
    return out.sequences[0, len(input_ids):].tolist(), [scores[0].float() for scores in out.scores]


def reference_prompt_logprobs(model, input_ids: list[int], **media) -> torch.Tensor:
    """transformers' log-softmax (float32 ``[L - 1, vocab]``, on the CPU) at each prompt position but the last: the
    distribution each later prompt token was drawn from; ``media`` as :func:`reference_generate` takes it."""
    ids = torch.tensor([input_ids], device=model.device)
    with torch.no_grad():
        logits = model(ids, **media_kwargs(model, ids, **media)).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def internvl_prompt(tokenizer, images: list[int], frames: int, text: str = "Describe what you see, briefly."
                    ) -> list[int]:
    """An InternVL3 chat prompt (the chat template's) with transformers' InternVLProcessor expansions
    (``replace_image_token``, ``replace_video_token``): an image of ``n`` tiles (``images``, in order) is ``<img>`` +
    256 * n ``<IMG_CONTEXT>`` + ``</img>``; a video of ``frames`` frames is ``Frame{i}: <img>...</img>`` per frame,
    one per line."""
    content = [{"type": "image"} for _ in images] + ([{"type": "video"}] if frames else [])
    content.append({"type": "text", "text": text})
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    for tiles in images:
        prompt = prompt.replace("<IMG_CONTEXT>\n", f"<img>{'<IMG_CONTEXT>' * 256 * tiles}</img>\n", 1)
    frame_text = "\n".join(f"Frame{i + 1}: <img>{'<IMG_CONTEXT>' * 256}</img>" for i in range(frames))
    return tokenizer(prompt.replace("<video>", frame_text))["input_ids"]


def assert_same_or_tie(ours: list[int], theirs: list[int], ref_logits: list[torch.Tensor]) -> None:
    """Equal ids; at the first difference the reference's top two logits must be a genuine tie."""
    assert len(ours) == len(theirs), f"{len(ours)} tokens, reference {len(theirs)}"
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            top2 = ref_logits[step].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TIE, f"step {step}: ours {a}, reference {b}; the reference's top-2 gap {gap:.2e} is no tie"
            return


def server_request_reference(model, tokenizer, text: str, max_new_tokens: int, *, video: bytes | None = None,
                             image: bytes | None = None, images: tuple[bytes, ...] = (),
                             params: RequestParams = RequestParams()):
    """What the server must produce for a ``text_input`` request (its images, then its video, then ``text``) to the
    model's family: ``reference_generate`` on :func:`server_request_inputs`."""
    ids, media = server_request_inputs(model, tokenizer, text, video=video, image=image, images=images, params=params)
    return reference_generate(model, ids, max_new_tokens, params=params, **media)


def server_request_inputs(model, tokenizer, text: str, *, video: bytes | None = None, image: bytes | None = None,
                          images: tuple[bytes, ...] = (), params: RequestParams = RequestParams()
                          ) -> tuple[list[int], dict]:
    """The prompt ids and media arguments (``reference_generate``'s) the server makes of a ``text_input`` request
    (its images, then its video, then ``text``) to the model's family: the same preprocessing (flashcodec's plan and
    patches, from the decoder its stage takes on the model's device: NVDEC on a GPU, whose pixels the GPU tests hold
    to the CPU decoder's within a tolerance; the orchestrator's prompt). Qwen2.5-VL: at most one ``image`` and one
    ``video``; InternVL3: any ``images`` (or ``image``) and a ``video``, as one ``tiles`` tensor in prompt order."""
    # Imported here so the runtime tests that only need reference_generate run without PyAV.
    from flashcodec.families.internvl3_pixels import tiles_from_rows
    from flashcodec.pipeline import image_group, iter_video_groups, make_decoder
    from orchestrator.inputs import MediaInput
    from orchestrator.media import plan_media
    from orchestrator.prompt import build_prompt

    family = _media_family(model)
    items = [("image", data) for data in ((image,) if image is not None else ()) + tuple(images)]
    items += [("video", video)] if video is not None else []
    media, rows = [], []
    for kind, data in items:
        plan = plan_media(MediaInput(kind, data=data), params, family)
        if kind == "video":
            choice = make_decoder(model.device, cpu_workers=1)
            try:
                rows.append(torch.cat([patches for _, patches in iter_video_groups(data, plan, choice.decoder)]))
            finally:
                choice.close()
        else:
            rows.append(image_group(data, plan))
        media.append((kind, plan.grid_thw, getattr(plan, "second_per_grid_t", 0.0)))
    prompt = build_prompt(tokenizer, text, media, family)
    if family.name == "internvl3":
        kwargs = {"tiles": torch.cat([tiles_from_rows(r, grid[0], 3, 14) for r, (_, grid, _) in zip(rows, media)])
                  } if media else {}
    else:
        kwargs = {kind: (r, grid, seconds) for r, (kind, grid, seconds) in zip(rows, media)}
    return list(prompt.input_ids), kwargs


def _media_family(model):
    """The served family's media rules (``flashcodec.families``) for ``model``."""
    from backends.runtime.families.registry import family_for
    from flashcodec.families import family

    return family(family_for(model.config).name)


def reference_prompt(model, tokenizer, text: str) -> list[int]:
    """The prompt token ids the server builds for a text-only ``text_input`` request to ``model``'s family."""
    from orchestrator.prompt import build_prompt

    return list(build_prompt(tokenizer, text, [], _media_family(model)).input_ids)
