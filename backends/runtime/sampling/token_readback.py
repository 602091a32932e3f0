"""A decode step's sampled token ids on their way to the host, while the next step already uses them on the GPU.

A decode step ends with the host reading its tokens (stop checks, streaming). Read at once, the GPU idles from
the end of the step until the host has launched the next one (bench/RESULTS.md, "decode step, overlapped"
against "decode step, planned ahead"). vLLM's async scheduling and SGLang's overlap scheduler launch step N+1
with step N's tokens still on the device and read step N's while N+1 runs; :class:`TokenReadback` is that
hand-over: the tokens stay on the device for the next step's inputs, and one asynchronous copy to pinned memory,
with an event, brings them to the host.
"""
from __future__ import annotations

import torch

from backends.runtime.sampling.sampler import upload


class TokenReadback:
    """``tokens``: int64 ``[b]`` on any device, as ``sampler.sample_tensor`` returns them (not copied: they must
    not be written afterwards); ``figures``: a float32 tensor that goes to the host with them, or None (the asking
    rows' log probabilities: ``backends.runtime.sampling.logprobs.finish``). On CUDA the copies to the host are
    queued on the current stream at construction; on the CPU there is nothing to wait for."""

    def __init__(self, tokens: torch.Tensor, figures: torch.Tensor | None = None) -> None:
        self.on_device = tokens
        self._copied: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self._host = _to_pinned(tokens)
            self._figures = None if figures is None else _to_pinned(figures)
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(tokens.device))
        else:
            self._host, self._figures = tokens, figures

    def next_inputs(self, rows: list[int | None], host_tokens: list[int]) -> torch.Tensor:
        """The next step's token ids, int64 ``[len(rows)]`` on the device, without waiting for the device: entry
        ``i`` is this step's token of row ``rows[i]``, or ``host_tokens[i]`` where ``rows[i]`` is None (a sequence
        not in this step). The tokens themselves when ``rows`` is ``0 .. b-1``, else a new tensor (a gather, and the
        host's tokens written in), its indices and values in one upload from pinned memory."""
        if rows == list(range(self.on_device.shape[0])):
            return self.on_device
        joining = [i for i, row in enumerate(rows) if row is None]
        packed = torch.tensor([0 if row is None else row for row in rows] + joining
                              + [host_tokens[i] for i in joining])
        gather, where, values = upload(packed, self.on_device.device).split([len(rows), len(joining), len(joining)])
        tokens = self.on_device.index_select(0, gather)
        return tokens.index_copy_(0, where, values) if joining else tokens

    def wait(self) -> None:
        """Block until the tokens are on the host (the step that made them has finished on the device)."""
        if self._copied is not None:
            self._copied.synchronize()

    def tolist(self) -> list[int]:
        """The token ids on the host, after :meth:`wait`."""
        self.wait()
        return self._host.tolist()

    def figures(self) -> list[list[float]]:
        """The ``figures`` rows on the host (``[]`` when there were none), after :meth:`wait`."""
        self.wait()
        return [] if self._figures is None else self._figures.tolist()


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of ``tensor``, queued on the current stream (not waited for)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
