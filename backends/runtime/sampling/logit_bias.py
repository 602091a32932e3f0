"""OpenAI's and vLLM's ``logit_bias``: per request, biases added to some tokens' logits before the penalties and
sampling (``SamplingParams.logit_bias``), in the order vLLM v1 applies them (its logits processors, then the
penalties; the log probabilities are taken before either: ``backends.runtime.sampling.logprobs``).

A batch's biases go to the device as one upload of ``[3, n]`` float64 (rows, token ids, biases: ids below 2**31
are exact), and one ``index_put_`` adds them to a float32 copy of the logits: nothing waits for the device. The
decode loop samples the same rows step after step, so :class:`LogitBias` keeps the upload while the batch's rows
keep their ``SamplingParams`` (a request's 300 biases at most: ``orchestrator.sampling_params``).
"""
from __future__ import annotations

import numpy as np
import torch

from backends.ipc.protocol import SamplingParams
from backends.runtime.sampling.sampler import upload


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits`` (floating ``[b, V]``, not changed) with each row's ``logit_bias`` added, as a new float32 tensor;
    ``logits`` itself when no row has a bias. An id >= V raises IndexError on the CPU and is a device-side assert on
    CUDA: the orchestrator refuses those at admission."""
    packed = packed_bias(params, logits.device)
    return logits if packed is None else biased(logits, packed)


def packed_bias(params: list[SamplingParams], device: torch.device) -> torch.Tensor | None:
    """The batch's (row, token id, bias) triples as float64 ``[3, n]`` on ``device`` (one upload, not waited for),
    or None when no row has a bias."""
    rows = [row for row, p in enumerate(params) for _ in p.logit_bias]
    if not rows:
        return None
    ids = [token for p in params for token, _ in p.logit_bias]
    biases = [bias for p in params for _, bias in p.logit_bias]
    return upload(torch.from_numpy(np.array([rows, ids, biases], dtype=np.float64)), device)


def biased(logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """A float32 copy of ``logits`` with :func:`packed_bias`'s biases added (one copy whatever the logits' dtype)."""
    out = logits.to(torch.float32, copy=True)
    return out.index_put_((packed[0].long(), packed[1].long()), packed[2].float(), accumulate=True)


class LogitBias:
    """:func:`apply_logit_bias` for a loop that samples the same sequences step after step (decode): the packed
    upload is made again only when the batch's rows are not the same ``SamplingParams`` objects as the step
    before (held here, so none of them is freed and its id reused while compared)."""

    def __init__(self) -> None:
        self._params: list[SamplingParams] = []
        self._packed: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """As :func:`apply_logit_bias`."""
        if not any(p.logit_bias for p in params):
            return logits
        if len(params) != len(self._params) or any(a is not b for a, b in zip(params, self._params)) \
                or self._packed is None or self._packed.device != logits.device:
            self._params, self._packed = list(params), packed_bias(params, logits.device)
        return biased(logits, self._packed)
