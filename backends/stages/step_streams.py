"""encode_prefill's steps on fewer SMs where the orchestrator asks (issue 19), on the whole GPU otherwise.

A CUDA green context (``torch.cuda.green_contexts.GreenContext``) of ``sms_while_decoding`` SMs is made once, at load,
with one stream of its own; a step the orchestrator marks (``StepPlan.fewer_sms``: a video's chunks beside streams
with a tight TBT target, ``orchestrator.fewer_sms``) runs on that stream, any other on the stage's ordinary stream
(the step thread's current one). Kernels on the green stream use
only the context's SMs, so decode's kernels, in their own process, find the others free; this helps only where the
two processes' kernels run at once (CUDA MPS), never under time slicing.

Steps do not always wait for the device (a middle prefill chunk does not), the next chunk reads the KV the last one
wrote, and memory a step frees goes back to the caching allocator's pool of the stream it was used on: so when a step
runs on another stream than the step before, that stream first waits for the other (``wait_stream``).
"""
from __future__ import annotations

import contextlib
import ctypes
from typing import Iterator

import torch


class StepStreams:
    """Picks each step's stream on ``device``. ``sms_while_decoding``: SMs of the green context (0: off, every step
    on the ordinary stream and no CUDA call made here; the driver may round the count up to its SM-group size).

    ``GreenContext.create`` is called with keyword arguments (``num_sms``, ``device_id``): torch 2.10 takes them as
    ``create(num_sms, device_id=0)``, 2.12+ as keyword-only ones; torch 2.11's signature is unverified.

    Raises ValueError at construction: ``sms_while_decoding`` negative, non-zero on a device that is not CUDA, above
    the device's SM count, or non-zero where the installed torch's ``GreenContext`` has no ``Stream``.
    """

    def __init__(self, device: torch.device, sms_while_decoding: int = 0):
        self.device = device
        self.sms = sms_while_decoding
        self.green: torch.cuda.Stream | None = None
        self._on_green = False  # the last step ran on the green stream
        if sms_while_decoding < 0:
            raise ValueError(f"sms_while_decoding must be 0 (off) or a number of SMs, got {sms_while_decoding}")
        if sms_while_decoding == 0:
            return
        if device.type != "cuda":
            raise ValueError(f"sms_while_decoding {sms_while_decoding} needs a CUDA device (a green context of "
                             f"that many SMs), got {device}; 0 turns it off")
        total = torch.cuda.get_device_properties(device).multi_processor_count
        if sms_while_decoding > total:
            raise ValueError(f"sms_while_decoding must be between 1 and {device}'s {total} SMs (or 0: off), got "
                             f"{sms_while_decoding}")
        from torch.cuda.green_contexts import GreenContext
        if not hasattr(GreenContext, "Stream"):
            raise ValueError(f"sms_while_decoding needs GreenContext.Stream, which torch {torch.__version__} lacks; "
                             f"set it to 0")
        index = device.index if device.index is not None else torch.cuda.current_device()
        context = GreenContext.create(num_sms=sms_while_decoding, device_id=index)
        # Never destroyed: a tensor that was used on the green stream and is freed after its context (at exit, or
        # when this object goes first) aborts the process ("CUDA error: context is destroyed" recording its event;
        # torch 2.11 on the H200, 2026-12-02). One context per stage process; the driver frees it at exit.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(context))
        self.green = context.Stream()

    def step_sms(self, fewer_sms: bool) -> int | None:
        """The SMs a step's kernels may use: the green context's count for a step marked ``fewer_sms`` (the count
        asked for: the driver may give a few more), None (the device's) for any other or without a green context."""
        return self.sms if fewer_sms and self.green is not None else None

    @contextlib.contextmanager
    def for_step(self, fewer_sms: bool) -> Iterator[None]:
        """Runs the block (one step's device work) on the green stream when ``fewer_sms``, on the current stream
        otherwise, after that stream waits for the other one if the last step ran there."""
        if self.green is None:
            yield
            return
        ordinary = torch.cuda.current_stream(self.device)
        if fewer_sms != self._on_green:
            new, old = (self.green, ordinary) if fewer_sms else (ordinary, self.green)
            new.wait_stream(old)
            self._on_green = fewer_sms
        with torch.cuda.stream(self.green) if fewer_sms else contextlib.nullcontext():
            yield
