"""Decode attention and KV writes of Qwen2.5-VL-7B's shape alone, per library kernel and plan option (issue 4).

    python3 bench/attention_probe.py --out DIR [--batches 1 8 32 64] [--context 4096]

No model: a random bf16 KV pool of the 7B's shape (28 layers, 28 query / 4 KV heads, head_dim 128, pages of 16
tokens) and, per batch size, ``batch`` sequences of ``context`` cached tokens each. Each variant runs all 28
layers' decode attention in one CUDA graph (the serving setup); its median replay time and KV bandwidth are
reported, with its largest difference from the runner's current kernel (flashinfer's tensor-core decode, "fa2",
its default split of the KV) on the same inputs. Variants:

* ``fa2``: ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True, use_cuda_graph=True)``, default plan;
* ``fa2_split<n>``: the same, ``plan(fixed_split_size=n)`` (KV chunks of ``n`` pages per CTA);
* ``fa2_nosplit``: ``plan(disable_split_kv=True)`` (one CTA per sequence and KV head, no merge);
* ``fa3``: the same wrapper with ``backend="fa3"`` (flashinfer's Hopper prefill kernels);
* ``xqa``: ``flashinfer.decode.trtllm_batch_decode_with_kv_cache(backend="xqa")`` (TensorRT-LLM's XQA
  decode kernels, a block table ``[batch, pages]`` and uint32 lengths instead of flashinfer's page list).

KV writes of one new token per sequence, all layers in a graph: ``index_put_x2`` (the runner's
``kv_cache.write_kv``, keys and values one indexing kernel each), ``index_put_kv`` (keys and values as one
``[2, batch, heads * head_dim]`` tensor, one indexing kernel) and ``append_paged_kv_cache`` (flashinfer's).

A variant that fails (a plan the graph mode rejects, a kernel that does not compile) is recorded with its error.
Writes ``<out>/attention_probe.json``.
"""
from __future__ import annotations

import argparse
import math
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backends.runtime.language_model.kv_cache import pages_needed, write_kv  # noqa: E402
from bench.common import H200_HBM_BYTES_PER_S, graph_ms, header, write  # noqa: E402

DEVICE = torch.device("cuda", 0)
LAYERS, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE = 28, 28, 4, 128, 16
DTYPE = torch.bfloat16
WORKSPACE_BYTES = 256 << 20
SPLITS = (4, 8, 16, 32, 64)


class Layout:
    """``batch`` sequences of ``context`` tokens, sequence i in pages ``i*per_seq ..``, on the device."""

    def __init__(self, batch: int, context: int) -> None:
        self.batch, self.context = batch, context
        self.per_seq = pages_needed(context, PAGE)
        pages = torch.arange(batch * self.per_seq, dtype=torch.int32, device=DEVICE)
        self.indices = pages
        self.indptr = torch.arange(0, batch * self.per_seq + 1, self.per_seq, dtype=torch.int32, device=DEVICE)
        self.last_page_len = torch.full((batch,), context - (self.per_seq - 1) * PAGE, dtype=torch.int32,
                                        device=DEVICE)
        self.block_tables = pages.view(batch, self.per_seq)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        self.slots = (torch.arange(batch, device=DEVICE) * self.per_seq * PAGE + context - 1).long()


def flashinfer_decode(pool, layout: Layout, backend: str, **plan_kwargs):
    """A per-layer decode function of flashinfer's tensor-core decode wrapper in CUDA-graph mode, planned."""
    import flashinfer

    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=DEVICE)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, backend=backend,
        paged_kv_indptr_buffer=layout.indptr.clone(), paged_kv_indices_buffer=layout.indices.clone(),
        paged_kv_last_page_len_buffer=layout.last_page_len.clone())
    wrapper.plan(layout.indptr, layout.indices, layout.last_page_len, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE,
                 q_data_type=DTYPE, kv_data_type=DTYPE, **plan_kwargs)
    return lambda q, layer: wrapper.run(q, (pool[layer, 0], pool[layer, 1]))


def xqa_decode(pool, layout: Layout):
    """A per-layer decode function of flashinfer's XQA decode kernels."""
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=DEVICE)
    seq_lens = layout.seq_lens.to(torch.uint32)
    max_len = layout.per_seq * PAGE
    return lambda q, layer: trtllm_batch_decode_with_kv_cache(
        q, (pool[layer, 0], pool[layer, 1]), ws, layout.block_tables, seq_lens, max_len,
        bmm1_scale=1 / math.sqrt(HEAD_DIM), kv_layout="NHD", backend="xqa")


def variants(pool, layout: Layout) -> dict:
    """Name -> factory of a per-layer decode function ``f(q, layer) -> out``."""
    found = {"fa2": lambda: flashinfer_decode(pool, layout, "auto")}
    for n in SPLITS:
        found[f"fa2_split{n}"] = lambda n=n: flashinfer_decode(pool, layout, "auto", fixed_split_size=n)
    found["fa2_nosplit"] = lambda: flashinfer_decode(pool, layout, "auto", disable_split_kv=True)
    found["xqa"] = lambda: xqa_decode(pool, layout)  # these two compile kernels the JIT cache lacks
    found["fa3"] = lambda: flashinfer_decode(pool, layout, "fa3")
    return found


def kv_writes(pool, layout: Layout) -> dict:
    """Name -> one layer's write of one new key/value per sequence (``f(k, v, layer)``)."""
    import flashinfer

    batch_indices = torch.arange(layout.batch, dtype=torch.int32, device=DEVICE)
    positions = torch.full((layout.batch,), layout.context - 1, dtype=torch.int32, device=DEVICE)
    _, _, num_pages, page, heads, dim = pool.shape

    def index_put_kv(k, v, layer):
        pool[layer].view(2, num_pages * page, heads * dim)[:, layout.slots] = torch.stack((k, v)).flatten(2)

    return {"index_put_x2": lambda k, v, layer: write_kv(pool, layer, k, v, layout.slots),
            "index_put_kv": index_put_kv,
            "append_paged_kv_cache": lambda k, v, layer: flashinfer.append_paged_kv_cache(
                k, v, batch_indices, positions, (pool[layer, 0], pool[layer, 1]), layout.indices, layout.indptr,
                layout.last_page_len)}


def probe(batch: int, context: int, pool) -> dict:
    layout = Layout(batch, context)
    kv_bytes = batch * context * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    q = torch.randn(batch, QO_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    row = {"batch": batch, "context": context, "kv_bytes": kv_bytes,
           "kv_floor_ms": kv_bytes / H200_HBM_BYTES_PER_S * 1e3, "attention": {}, "kv_write": {}}
    reference = None
    for name, factory in variants(pool, layout).items():
        try:
            decode = factory()
            with torch.inference_mode():
                out = decode(q, 0).float()
                ms = graph_ms(lambda: [decode(q, layer) for layer in range(LAYERS)])
            reference = out if reference is None else reference
            entry = {"ms": ms, "kv_tb_per_s": kv_bytes / ms / 1e9, "max_abs_diff_vs_fa2":
                     (out - reference).abs().max().item()}
        except Exception as exc:  # a rejected plan or a kernel that does not build here: recorded
            entry = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            traceback.print_exc()
        row["attention"][name] = entry
        print(f"b={batch} {name}: {entry}", flush=True)
    k = torch.randn(batch, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    for name, fn in kv_writes(pool, layout).items():
        try:
            with torch.inference_mode():
                fn(k, v, 0)
                ok = torch.equal(pool[0, 1].view(-1, KV_HEADS, HEAD_DIM)[layout.slots], v)
                ms = graph_ms(lambda: [fn(k, v, layer) for layer in range(LAYERS)])
            entry = {"ms": ms, "writes_values_right": ok}
        except Exception as exc:
            entry = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            traceback.print_exc()
        row["kv_write"][name] = entry
        print(f"b={batch} kv write {name}: {entry}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_probe needs a CUDA GPU")
    results = header(DEVICE, ("flashinfer",))
    pages = max(args.batches) * pages_needed(args.context, PAGE)
    pool = torch.randn(LAYERS, 2, pages, PAGE, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    results["decode"] = []
    for batch in args.batches:
        results["decode"].append(probe(batch, args.context, pool))
        write(Path(args.out), "attention_probe", results)


if __name__ == "__main__":
    main()
