"""encode_prefill's kernels on a CUDA green context of fewer SMs than the device (issue 19), alone on the GPU.

    python3 bench/green_context_probe.py --out DIR [--sms 120 112] [--context 100000]

Beside decode, a video's steps run on a green context of ``sms_while_decoding`` SMs (``backends/stages/
step_streams.py``). There they took 1.7-1.8x their time on the whole GPU (the fourteenth peer run, 2026-12-04: the
vision tower 7.1 us a patch against 3.9, a 2,048-token chunk's prefill 38.5 us a token against 23, its attention over
a long cache about 2.3x), where 120 of 132 SMs would explain 1.1x. Kernels that size their work to the device's SM
count run their CTAs beyond the context's SMs as a second round: this probe times the suspects alone (no decode
beside them), each (median of CUDA events) on the whole GPU, on the green context as served, and with a remedy:

* ``gemm_llm``: ``[2048, 3584] x [3584, 37888]`` bf16 (a 2,048-token chunk through the 7B's fused MLP
  up-projection); ``gemm_vision``: ``[9504, 1280] x [1280, 3420]`` (the vision tower's MLP, one step's patches);
  remedy: torch's SM carveout (``cublasSetSmCountTarget``: the device's SMs less the context's);
* ``fa3_prefill``: flashinfer's FA3 paged prefill of a 2,048-row chunk after ``--context`` cached tokens (the 7B's
  28 query / 4 KV heads, head_dim 128, pages of 16); remedy: the chunk's rows cut into groups of at most the
  context's SMs in work items (``sm_partition.row_groups``), one kernel call each; ``split_max_abs_diff``: its
  largest difference from one call.

On the H200 (2026-12-04, ``bench/results/green-context-probe-h200-2026-12-04/``) the GEMMs took what 120 SMs predict
(1.12x) and the carveout changed nothing; FA3 took 9.3 ms on 120 SMs against 5.6 on the whole GPU, and 5.6 in four
row groups (the same output): the remedy the attention backend applies since.

Writes ``<out>/green_context_probe.json``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from backends.runtime.attention.sm_partition import group_layout, group_rows, row_groups  # noqa: E402
from bench.common import cuda_time_ms, header, write  # noqa: E402

DEVICE = torch.device("cuda", 0)
QO_HEADS, KV_HEADS, HEAD_DIM, PAGE, CHUNK = 28, 4, 128, 16, 2048
DTYPE = torch.bfloat16
REPEATS = 20


def carveout(value: int | None) -> None:
    torch._C._set_sm_carveout_experimental(value)


def gemm_case(m: int, k: int, n: int, green: torch.cuda.Stream, device_sms: int, sms: int) -> dict:
    a, b = torch.randn(m, k, dtype=DTYPE, device=DEVICE), torch.randn(k, n, dtype=DTYPE, device=DEVICE)
    result = {"whole_gpu_ms": cuda_time_ms(lambda: a @ b, REPEATS)}
    with torch.cuda.stream(green):
        result["green_ms"] = cuda_time_ms(lambda: a @ b, REPEATS)
        carveout(device_sms - sms)
        try:
            result["green_sm_target_ms"] = cuda_time_ms(lambda: a @ b, REPEATS)
        finally:
            carveout(None)
    result["tflops_whole_gpu"] = 2 * m * k * n / result["whole_gpu_ms"] / 1e9
    return result


class Fa3Chunk:
    """One sequence: ``context`` cached tokens and a ``CHUNK``-row chunk, its KV already in the pages."""

    def __init__(self, context: int) -> None:
        import flashinfer

        total = context + CHUNK
        pages = -(-total // PAGE)
        self.kv = tuple(torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE) for _ in range(2))
        self.q = torch.randn(CHUNK, QO_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        self.indptr = np.array([0, pages], dtype=np.int32)
        self.indices = np.arange(pages, dtype=np.int32)
        self.last = np.array([total - (pages - 1) * PAGE], dtype=np.int32)
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
        self._new = lambda: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="auto")

    def planned(self, groups: list) -> list:
        """(rows, wrapper) per group, each wrapper planned for its pieces."""
        planned = []
        for pieces in groups:
            qo, indptr, indices, last = (torch.from_numpy(x) for x in group_layout(
                pieces, [CHUNK], self.indptr, self.indices, self.last, PAGE))
            wrapper = self._new()
            wrapper.plan(qo, indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE, causal=True,
                         q_data_type=DTYPE, kv_data_type=DTYPE)
            planned.append((group_rows(pieces, [0, CHUNK]), wrapper))
        return planned

    def run(self, planned: list, out: torch.Tensor) -> None:
        for rows, wrapper in planned:
            wrapper.run(self.q[rows], self.kv, out=out[rows])


def fa3_case(context: int, green: torch.cuda.Stream, sms: int) -> dict:
    chunk = Fa3Chunk(context)
    whole = chunk.planned([[(0, 0, CHUNK)]])
    groups = row_groups([CHUNK], QO_HEADS, HEAD_DIM, sms)
    split = chunk.planned(groups)
    reference, out = torch.empty_like(chunk.q), torch.empty_like(chunk.q)
    chunk.run(whole, reference)
    result = {"context": context, "groups": len(groups),
              "whole_gpu_ms": cuda_time_ms(lambda: chunk.run(whole, out), REPEATS)}
    with torch.cuda.stream(green):
        result["green_ms"] = cuda_time_ms(lambda: chunk.run(whole, out), REPEATS)
        result["green_split_ms"] = cuda_time_ms(lambda: chunk.run(split, out), REPEATS)
        chunk.run(split, out)
    torch.cuda.synchronize()
    result["split_max_abs_diff"] = (out.float() - reference.float()).abs().max().item()
    result["whole_gpu_split_ms"] = cuda_time_ms(lambda: chunk.run(split, out), REPEATS)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sms", type=int, nargs="+", default=[120, 112])
    parser.add_argument("--context", type=int, default=100_000)
    args = parser.parse_args()
    from torch.cuda.green_contexts import GreenContext

    device_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    report = {**header(DEVICE, ("flashinfer",)), "device_sms": device_sms, "by_sms": {}}
    contexts = []
    for sms in args.sms:
        context = GreenContext.create(num_sms=sms, device_id=0)
        contexts.append(context)  # alive until the end: a stream outliving its context fails ("context is destroyed")
        green = context.Stream()
        cases = {"gemm_llm": gemm_case(CHUNK, 3584, 37888, green, device_sms, sms),
                 "gemm_vision": gemm_case(9504, 1280, 3420, green, device_sms, sms),
                 "fa3_prefill": fa3_case(args.context, green, sms)}
        report["by_sms"][str(sms)] = cases
        print(sms, cases, flush=True)
    write(args.out, "green_context_probe", report)


if __name__ == "__main__":
    main()
