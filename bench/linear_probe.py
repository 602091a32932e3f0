"""Which library path streams a decode step's weights fastest at small batch (issue 4, batch-1 target).

    python3 bench/linear_probe.py --out DIR

The step's matrix products alone, for Qwen2.5-VL-7B's shapes (28 layers of fused q/k/v, o, fused gate/up and
down, plus the LM head: 14.1 GB of random bf16 weights), captured in one CUDA graph and replayed, at batch 1
and 8, through: torch's ``F.linear`` with cuBLAS as torch picks it (``default``), with the cuBLASLt backend
preferred (``cublaslt``), and inductor's ``max-autotune`` (Triton templates against aten, per shape; batch 1).
Bandwidth = weight bytes / time, against the measured 4.3 TB/s copy. Writes ``<out>/linear_probe.json``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import H200_HBM_BYTES_PER_S, graph_ms, header, write  # noqa: E402

HIDDEN, INTER, LAYERS, VOCAB, QKV = 3584, 18944, 28, 152064, 3584 + 2 * 512
DEVICE = torch.device("cuda", 0)


def weights() -> list[tuple[torch.Tensor, ...]]:
    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02

    layers = [(w(QKV, HIDDEN), torch.randn(QKV, device=DEVICE, dtype=torch.bfloat16), w(HIDDEN, HIDDEN),
               w(2 * INTER, HIDDEN), w(HIDDEN, INTER)) for _ in range(LAYERS)]
    return layers + [(w(VOCAB, HIDDEN),)]


def step(linear, layers, x: torch.Tensor) -> None:
    for wqkv, bqkv, wo, wgu, wd in layers[:-1]:
        linear(linear(x, wqkv, bqkv)[:, :HIDDEN], wo, None)
        linear(linear(x, wgu, None)[:, :INTER], wd, None)
    linear(x, layers[-1][0], None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = header(DEVICE)
    layers = weights()
    total = sum(t.numel() * t.element_size() for layer in layers for t in layer)
    results["weight_bytes"], results["rows"] = total, []

    def record(variant: str, batch: int, ms: float) -> None:
        row = {"variant": variant, "batch": batch, "ms": ms, "tb_per_s": total / ms / 1e9,
               "of_copy_bandwidth": total / ms / 1e-3 / H200_HBM_BYTES_PER_S}
        results["rows"].append(row)
        print(f"{variant:10s} b={batch}: {ms:.3f} ms, {row['tb_per_s']:.2f} TB/s ({row['of_copy_bandwidth']:.0%})",
              flush=True)

    with torch.inference_mode():
        for batch in (1, 8):
            x = torch.randn(batch, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
            record("default", batch, graph_ms(lambda: step(F.linear, layers, x), 30, warmup=2))
            default = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            record("cublaslt", batch, graph_ms(lambda: step(F.linear, layers, x), 30, warmup=2))
            torch.backends.cuda.preferred_blas_library(default)
        x = torch.randn(1, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
        try:
            tuned = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
            record("autotune", 1, graph_ms(lambda: step(tuned, layers, x), 30, warmup=2))
        except Exception as exc:  # a probe: report and keep what was measured
            results["autotune_error"] = repr(exc)[:500]
            print("autotune failed:", repr(exc)[:500], flush=True)
    write(Path(args.out), "linear_probe", results)


if __name__ == "__main__":
    main()
